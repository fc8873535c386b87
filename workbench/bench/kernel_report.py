"""The kernel benchmark's output: its CSV (appended, one header) and its text table."""

from __future__ import annotations

import csv
import math
from pathlib import Path

from workbench.bench.kernel_timing import INTERPRETER_NOTE, ROW_FIELDS
from workbench.errors import WorkbenchError


def check_csv(path: str | Path) -> None:
    """Refuse (before running) to append to a CSV whose header is not :data:`ROW_FIELDS`."""
    p = Path(path)
    if p.is_file() and p.stat().st_size:
        with open(p, newline="") as f:
            header = next(csv.reader(f), [])
        if header != ROW_FIELDS:
            raise WorkbenchError(f"{p}: its columns differ from this benchmark's ({len(header)} vs "
                                 f"{len(ROW_FIELDS)}); pass another --csv path or move the old file")


def append_csv(rows: list[dict], path: str | Path) -> Path:
    p = Path(path)
    check_csv(p)
    p.parent.mkdir(parents=True, exist_ok=True)
    new = not p.is_file() or not p.stat().st_size
    with open(p, "a", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_FIELDS, extrasaction="ignore")
        if new:
            w.writeheader()
        w.writerows(rows)
    return p


def _fmt(v, spec: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width text table (what the command prints last)."""
    if not rows:
        return "(no rows)"
    r0 = rows[0]
    head = (f"{r0['device']} ({r0['device_name']}); torch {r0['torch']}, triton {r0['triton']}"
            + ("; Triton interpreter ON" if r0["interpreter"] else ""))
    cols = f"{'section':<9}{'op':<14}{'provider':<14}{'dtype':<9}{'ms p50':>10}{'min..max':>19}{'achieved':>18}" \
           f"{'of ceil':>9}{'vs eager':>9}{'max err':>10}{'launch':>8}  sizes / status"
    lines = [head, cols, "-" * len(cols)]
    for r in rows:
        mark = "*" if r["timing"] == INTERPRETER_NOTE else " "
        ach = f"{_fmt(r['achieved'], '.3g')} {r['metric']}" if r["achieved"] is not None else "-"
        tail = r["sizes"] or ""
        if r["status"] != "ok":
            tail = f"{r['status'].upper()}: {r['error'] or r['note']}"
        lines.append(f"{r['section']:<9}{r['op']:<14}{(r['provider'] + mark):<14}{(r['dtype'] or '-'):<9}"
                     f"{_fmt(r['ms_median'], '.4f'):>10}"
                     f"{(_fmt(r['ms_min'], '.3f') + '..' + _fmt(r['ms_max'], '.3f')):>19}{ach:>18}"
                     f"{_fmt(r['frac_of_ceiling'], '.1%'):>9}{_fmt(r['vs_eager'], '.2f'):>9}"
                     f"{_fmt(r['max_err'], '.2e'):>10}{_fmt(r['launches_per_step'], '.0f'):>8}  {tail}")
    if any(r["timing"] == INTERPRETER_NOTE for r in rows):
        lines.append("* Triton interpreter (CPU): these times test the code path, they are not speed claims")
    if any((r["frac_of_ceiling"] or 0) > 1 for r in rows):
        lines.append("of ceil > 100%: the tensors fit in a cache that the copy ceiling's larger tensor does not "
                     "(small sizes); compare such rows only with each other")
    lines.append("achieved: from the row's stated formula; of ceil: fraction of the copy bandwidth / matmul rate "
                 "measured in this run (decode: of the roofline); vs eager: eager time / this time")
    return "\n".join(lines)
