"""The device check's compile accounting (``gpu_results.CompileLog``) hooks the Triton it runs with.

``CompileLog.install`` wraps ``JITFunction._do_compile`` (every JIT compile or cache load) and
``Autotuner._bench`` (one autotuned config); on a Triton without them it silently counts nothing, so
the device check's per-step ``compile_s`` would read 0.0 on the GPU.  Both names were read in
triton 3.6.0's wheel (the GPU image's: ``triton/runtime/jit.py`` ``_do_compile``,
``triton/runtime/autotuner.py`` ``_bench``); this test checks the Triton installed here, and
``.ci/run`` runs the same check (``check_triton_hooks``) with triton 3.6 in ``.venv-triton36``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# run in a fresh process: install() patches Triton's classes for the rest of the process
CHECK = "from workbench.measure.compile_log import check_triton_hooks; print(check_triton_hooks())"


def test_compile_log_hooks_the_installed_triton():
    pytest.importorskip("triton")
    r = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "TRITON_INTERPRET": "1"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert "CompileLog hooks triton" in r.stdout


def test_the_check_fails_on_a_triton_without_the_hooks(tmp_path):
    """The check itself can fail: a stand-in ``triton`` package whose classes lack both methods."""
    pkg = tmp_path / "triton"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "__init__.py").write_text("__version__ = '0.0-standin'\n")
    (pkg / "runtime" / "__init__.py").write_text("")
    (pkg / "runtime" / "jit.py").write_text("class JITFunction:\n    pass\n")
    (pkg / "runtime" / "autotuner.py").write_text("class Autotuner:\n    pass\n")
    r = subprocess.run([sys.executable, "-c", CHECK], cwd=ROOT, capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": f"{tmp_path}:{ROOT}", "PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "does not hook" in r.stderr
