"""The test files scripts/device_check.sh runs on a GPU put their models on the GPU.

There the kernels are compiled (no ``TRITON_INTERPRET``), and backend 'triton' refuses a model on
the CPU: a test file that builds its models with ``device="cpu"`` fails on the GPU (and ``-x``
then hides every CUDA test after it), while it passes here.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_test_files() -> list[str]:
    script = (ROOT / "scripts" / "device_check.sh").read_text()
    return sorted(set(re.findall(r"tests/[\w/]+\.py", script)))


def test_gpu_test_files_put_their_models_on_the_device():
    files = gpu_test_files()
    assert "tests/transforms/test_cuda_graphs.py" in files
    for f in files:
        src = (ROOT / f).read_text()
        assert 'device="cpu")' not in src, f"{f}: builds a model on the CPU; use DEVICE"
        if "init_weights(" in src or "LLM(" in src:
            assert "DEVICE" in src or '"cuda"' in src, f"{f}: builds models but never names the GPU"
