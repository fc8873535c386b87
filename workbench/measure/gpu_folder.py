"""The output folder of one device check and its ``meta.json``: a new ``results/gpu/<device>-<date>``
on a GPU (``-2``, ``-3`` ... for a second run that day), ``runs/device_check`` without one
(re-exported by :mod:`workbench.measure.gpu_results`).  Standard library only."""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
from datetime import datetime, UTC
from pathlib import Path

from workbench.measure.gpu_latest import REPO, RESULTS_ROOT

DRY_RUN_DIR = REPO / "runs" / "device_check"     # git-ignored: a run without CUDA writes here


def slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"nvidia-h200"`` (letters, digits and single dashes)."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown-device"


def _git(*args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def git_commit() -> str | None:
    """HEAD's commit (with ``-dirty`` when tracked files differ from it), or ``$GIT_COMMIT``
    where the checkout has no .git (a plain copy on a GPU machine)."""
    commit = _git("rev-parse", "HEAD")
    if commit is None:
        return os.environ.get("GIT_COMMIT") or None
    dirty = _git("status", "--porcelain", "--untracked-files=no")
    return commit + ("-dirty" if dirty else "")


def output_dir(device_name: str, now: datetime, root: str | Path | None = None) -> Path:
    """``<root>/<slug>-<YYYY-MM-DD>``; a second run of the day gets ``-2``, ``-3`` ..."""
    root = Path(root) if root is not None else RESULTS_ROOT
    base = f"{slug(device_name)}-{now:%Y-%m-%d}"
    folder, n = root / base, 1
    while folder.exists():
        n += 1
        folder = root / f"{base}-{n}"
    return folder


def start(probe: dict, out: str | Path | None = None, root: str | Path | None = None,
          dry_run_dir: str | Path | None = None, now: datetime | None = None) -> tuple[bool, Path]:
    """Choose and create the output folder, write its ``meta.json``; returns (cuda, folder).
    With CUDA: a new ``results/gpu/<device>-<date>`` (or ``out``); without: ``runs/device_check``
    (or ``out``), never ``results/gpu``."""
    now = now or datetime.now(UTC)
    cuda = bool(probe.get("cuda_available"))
    name = probe.get("device_name") or ("unknown GPU" if cuda else "cpu")
    if out:
        folder = Path(out)
    elif cuda:
        folder = output_dir(name, now, root)
    else:
        folder = Path(dry_run_dir) if dry_run_dir is not None else DRY_RUN_DIR
        if folder.is_dir():      # a dry run replaces the previous dry run's tables
            for p in folder.iterdir():
                if p.is_file() and (p.suffix in (".csv", ".log") or p.name == "meta.json"):
                    p.unlink()
    folder.mkdir(parents=True, exist_ok=True)
    meta = {
        "device_name": name,
        "date": f"{now:%Y-%m-%d}",
        "utc_time": now.strftime("%Y-%m-%dT%H:%M:%SZ"),
        "torch": probe.get("torch"),
        "triton": probe.get("triton"),
        "cuda": probe.get("cuda"),
        "git_commit": git_commit(),
        "python": probe.get("python") or platform.python_version(),
        "dry_run": not cuda,
    }
    for k in ("transformers", "numpy", "gpu", "host_cpus"):
        if probe.get(k) is not None:
            meta[k] = probe[k]
    (folder / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return cuda, folder
