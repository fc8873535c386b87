"""Reading the GPU results that last: the newest committed ``results/gpu/<device>-<date>/<table>.csv``
of a benchmark, and where it comes from (re-exported by :mod:`workbench.measure.gpu_results`,
which the notebooks import).  Standard library only; pandas is imported lazily, by
:attr:`GpuTable.frame` alone."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS_ROOT = REPO / "results" / "gpu"          # committed: measured on a GPU, never edited by hand

_DATE = re.compile(r"(\d{4}-\d{2}-\d{2})")


@dataclass
class GpuTable:
    """One committed GPU table: ``results/gpu/<folder>/<table>.csv`` and its folder's meta."""
    table: str
    folder: Path
    device: str                 # the GPU's name from meta.json ("NVIDIA H200"), else the folder's slug
    date: str                   # YYYY-MM-DD (UTC) from the folder name
    meta: dict = field(default_factory=dict)
    _frame: Any = field(default=None, repr=False)

    @property
    def path(self) -> Path:
        return self.folder / f"{self.table}.csv"

    @property
    def frame(self):
        """The table as a pandas DataFrame (read once)."""
        if self._frame is None:
            import pandas as pd  # lazy: pandas (~1 s); tests/measure/test_gpu_results.py keeps it out of the import

            self._frame = pd.read_csv(self.path)
        return self._frame

    @property
    def label(self) -> str:
        """``"NVIDIA H200, 2026-12-01"``: where and when the table was measured."""
        return f"{self.device}, {self.date}"

    def __str__(self) -> str:
        return self.label


def _folder_key(folder: Path) -> tuple[str, int, str]:
    """Sort key: the date in the name, then the same-day run number (``-2`` after none), then
    the name."""
    m = _DATE.search(folder.name)
    date = m.group(1) if m else ""
    rest = folder.name[m.end():] if m else ""
    run = int(rest[1:]) if re.fullmatch(r"-\d+", rest) else 1
    return date, run, folder.name


def result_folders(root: str | Path | None = None) -> list[Path]:
    """The dated result folders under ``root`` (default ``results/gpu``), oldest first."""
    root = Path(root) if root is not None else RESULTS_ROOT
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and _DATE.search(p.name)), key=_folder_key)


def read_meta(folder: str | Path) -> dict:
    try:
        meta = json.loads((Path(folder) / "meta.json").read_text())
    except (OSError, ValueError):
        return {}
    return meta if isinstance(meta, dict) else {}


def latest(table: str, root: str | Path | None = None) -> GpuTable | None:
    """The newest committed ``<table>.csv`` under ``root`` (default ``results/gpu``): by the date
    in the folder name, then the folder name; None when no folder has that table."""
    table = table.removesuffix(".csv")
    for folder in reversed(result_folders(root)):
        if (folder / f"{table}.csv").is_file():
            meta = read_meta(folder)
            if meta.get("dry_run"):         # a CPU dry run written here by hand (OUT_DIR): not a GPU figure
                continue
            date = _DATE.search(folder.name).group(1)
            slug = folder.name[:_DATE.search(folder.name).start()].rstrip("-") or folder.name
            return GpuTable(table=table, folder=folder, device=str(meta.get("device_name") or slug), date=date,
                            meta=meta)
    return None


def describe(table: str, root: str | Path | None = None) -> str:
    """Where the latest GPU table comes from ("on a GPU: NVIDIA H200, 2026-12-01
    (results/gpu/nvidia-h200-2026-12-01/sched_bench.csv)"), or that there is none."""
    found = latest(table, root)
    if found is None:
        return f"on a GPU: not measured yet (no results/gpu/*/{table.removesuffix('.csv')}.csv)"
    return f"on a GPU: {found.label} ({found.folder.name}/{found.table}.csv)"
