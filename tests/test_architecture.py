"""The package's architecture: one folder per layer, imports only downwards, a small public surface.

* ``lint-imports`` (import-linter, configured in ``.importlinter``) checks the layer order, that
  only ``lab`` and ``cli`` import plotly / ipywidgets / IPython, and that the scheduler and the
  block bookkeeping import neither torch nor numpy.  It reads imports statically, so
* a subprocess imports the pure modules (and ``workbench`` itself) and looks at ``sys.modules``:
  lazy exports must keep torch and plotly out until they are used.
* Every subpackage has an ``__all__`` whose names all resolve.
"""

from __future__ import annotations

import importlib
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ["workbench", "workbench.model", "workbench.kv", "workbench.prefetch", "workbench.sched",
            "workbench.transforms", "workbench.quant", "workbench.engine", "workbench.load", "workbench.serve",
            "workbench.bench", "workbench.bench.claims", "workbench.lab", "workbench.cli", "workbench.measure"]


def test_import_contracts_hold():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.fail("import-linter is not installed: it is in the dev extra (pip install -e '.[dev]')")
    r = subprocess.run([exe, "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    assert "0 broken" in r.stdout


def _modules_after(code: str) -> set[str]:
    r = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sorted(sys.modules)))"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    return set(r.stdout.split())


def test_scheduler_and_block_manager_import_without_torch():
    mods = _modules_after("import workbench.sched.scheduler, workbench.kv.block_manager, workbench.sched")
    assert "torch" not in mods and "numpy" not in mods
    assert "workbench.sched.scheduler" in mods and "workbench.kv.block_manager" in mods


def test_import_workbench_loads_neither_torch_nor_plotly():
    mods = _modules_after("import workbench, workbench.kv, workbench.engine, workbench.load, workbench.serve, "
                          "workbench.lab")
    assert not {"torch", "plotly", "ipywidgets", "starlette"} & mods
    mods = _modules_after("import workbench; workbench.SamplingParams")   # first use imports what it needs
    assert "workbench.engine.sampling" in mods and "torch" in mods


@pytest.mark.parametrize("package", PACKAGES)
def test_every_package_has_a_public_surface_that_resolves(package):
    mod = importlib.import_module(package)
    assert isinstance(getattr(mod, "__all__", None), list), f"{package} has no __all__"
    for name in mod.__all__:
        if name in ("LatencyStreamView", "KVBlockMapView", "LatencyDashboard") and importlib.util.find_spec(
                "ipywidgets") is None:
            continue
        assert getattr(mod, name) is not None, f"{package}.{name}"


def test_the_top_level_exports_what_a_user_needs():
    import workbench

    for name in ("LLM", "LLMEngine", "AsyncEngine", "SamplingParams", "SchedulerConfig", "PagedKVConfig",
                 "TierConfig", "load_model", "summarize", "Tokenizer", "WorkbenchError"):
        assert name in workbench.__all__ and getattr(workbench, name) is not None
