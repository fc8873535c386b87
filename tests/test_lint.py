"""ruff's lint over the package, its tests, scripts and kernels ([tool.ruff] in pyproject.toml says
which rules and why some are ignored): a finding fails the suite with ruff's own one-line reports."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ruff() -> str | None:
    exe = Path(sys.executable).with_name("ruff")
    return str(exe) if exe.exists() else shutil.which("ruff")


def test_ruff_check_is_clean():
    ruff = _ruff()
    if ruff is None:
        pytest.skip("ruff is not installed (pip install -e '.[dev]' brings it)")
    r = subprocess.run([ruff, "check", "--output-format", "concise", "--no-cache", "workbench", "tests", "scripts",
                        "kernels"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]
