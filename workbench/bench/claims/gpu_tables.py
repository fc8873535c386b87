"""The GPU claims' shared pieces: the committed GPU tables they read, where each comes from, and
the rule for a claimed level.

The GPU claims (17-21, :mod:`~workbench.bench.claims.catalogue`) are read from the committed GPU
results (``results/gpu/<device>-<date>/``, written by ``scripts/device_check.sh``).  No GPU is
needed here: each claim reads the newest committed table it needs (``ctx.gpu_table(name)`` ->
:func:`workbench.measure.gpu_results.latest`) and decides from the figures in it, naming the
folder, device, date and commit they came from.  Without that table the verdict is ``not
measured`` and the reason names the table and the device-check step that writes it (or says that
no step writes it yet).

A claimed level is *reproduced* when the measured range's low end reaches it (the ranges are the
device check's own min..max over interleaved runs); a range that straddles it is "within noise",
which counts as ``does not hold`` (:mod:`workbench.bench.claims.core`).  Each rule is a pure function
of the numbers (:func:`at_least`, ``full_stack_rule``, ...), unit-tested on synthetic tables.
"""

from __future__ import annotations

import math

from workbench.bench.claims.core import FAILS, HOLDS, NOT_MEASURED, Finding

# step of scripts/device_check.sh that writes each table, and the command it runs
STEPS = {
    "engine_bench": "engine_bench (`workbench bench --configs reference,loop,cuda-graphs --json`)",
    "engine_fast_bench": "engine_fast (`workbench bench --configs reference,compile,compile+graphs --json`)",
    "kernel_bench": "decode_roofline + kernels_bench (`workbench kernels-bench --size full --sections "
                    "ceilings,decode`, then `--sections kernels`)",
    "prefetch_bench": "prefetch_link + prefetch_bench (`python -m workbench.cli.gpu_results prefetch-link`, "
                      "then `prefetch-stream`)",
    "quant_bench": "quant_bench (`python -m workbench.cli.gpu_results quant-kernels`)",
    "calibrate": "calibrate (`workbench calibrate-quant --objective latency --json`)",
    "e2e": "e2e (notebook 06's ablation at its tiny size, `workbench.bench.end_to_end.run_end_to_end`)",
    "decode_stack": "decode_stack (`workbench decode-stack --json`)",
}


def source(t) -> str:
    """Where a GPU table comes from: ``results/gpu/<folder>/<table>.csv (device, date, commit)``."""
    commit = (t.meta or {}).get("git_commit") or "commit unknown"
    return f"results/gpu/{t.folder.name}/{t.table}.csv ({t.label}, commit {str(commit)[:12]})"


def not_measured(tables: list[str], what: str, missing_step: str | None = None) -> Finding:
    """The ``not measured`` finding: which tables, which device-check steps would write them."""
    steps = "; ".join(f"{t}.csv from step {STEPS[t]}" for t in tables if t in STEPS)
    reason = (f"no committed GPU run has {' / '.join(t + '.csv' for t in tables)} under results/gpu/ (needed: {what}); "
              f"scripts/device_check.sh writes {steps} on a GPU machine")
    if missing_step:
        reason += f".  Not written by the device check today: {missing_step}"
    reason += "."
    return Finding(NOT_MEASURED, "-", reason)


def at_least(lo: float, hi: float, target: float) -> str:
    """``holds`` when the low end reaches ``target``, else ``does not hold`` (a range that straddles
    it is within noise, which does not hold either)."""
    return HOLDS if lo >= target else FAILS


def _range_word(lo: float, hi: float, target: float) -> str:
    if lo >= target:
        return "reaches it"
    return "falls short" if hi < target else "straddles it (within noise)"


def _float(v):
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(f) else f


def _long_value(frame, section: str, metric: str):
    """One value of a long-format table (section, config, metric, value)."""
    rows = frame[(frame["section"] == section) & (frame["metric"] == metric)]
    return None if rows.empty else rows["value"].iloc[0]


def _decode_rows(frame) -> list[dict]:
    """The ok rows of a kernel_bench table's decode section, their figures as floats (None when missing)."""
    d = frame[(frame["section"] == "decode") & (frame["status"] == "ok")]
    rows = []
    for r in d.to_dict("records"):
        row = {"provider": r.get("provider"), "sizes": r.get("sizes"), "dtype": r.get("dtype")}
        for k in ("launches_per_step", "ms_median", "ms_min", "ms_max", "frac_of_ceiling", "achieved", "bytes",
                  "ceiling"):
            row[k] = _float(r.get(k))
        if row["ms_median"] is not None:
            rows.append(row)
    return rows
