"""A claims run as a table, as text and as the JSON document of ``workbench claims --json``;
:func:`problems` says what makes a run incomplete."""

from __future__ import annotations

import json
import platform

from workbench.bench.claims.core import (
    ERROR,
    FAILS,
    HOLDS,
    SOURCES,
    VERDICTS,
    ClaimContext,
    ClaimResult,
    _jsonable,
)


def problems(results: list[ClaimResult]) -> list[str]:
    """What makes a claims run incomplete: errors, and CPU claims without a measured verdict."""
    bad = []
    for r in results:
        if r.verdict == ERROR:
            bad.append(f"{r.id}: {r.error}")
        elif r.device == "cpu" and r.verdict not in (HOLDS, FAILS):
            bad.append(f"{r.id}: a CPU claim must be measured here, got {r.verdict!r} ({r.reason})")
        elif r.verdict in (HOLDS, FAILS) and not r.figure.strip("- "):
            bad.append(f"{r.id}: a verdict without a measured figure")
    return bad


def claims_table(results: list[ClaimResult]):
    """A DataFrame, one row per claim: id, source, claim, figure, verdict, reason, seconds."""
    import pandas as pd

    return pd.DataFrame([{"id": r.id, "layer": r.layer, "source": r.source, "claim": r.claim, "measured": r.figure,
                          "verdict": r.verdict, "why": r.reason, "device": r.device, "seconds": round(r.seconds, 1)}
                         for r in results]).set_index("id")


def verdict_counts(results: list[ClaimResult]) -> dict[str, int]:
    return {v: sum(r.verdict == v for r in results) for v in VERDICTS if any(r.verdict == v for r in results)}


def format_claims(results: list[ClaimResult], width: int = 100) -> str:
    """The claims as plain text: one block per claim."""
    import textwrap

    lines = []
    for r in results:
        lines.append(f"[{r.verdict.upper()}] {r.id} ({r.source}; {r.layer}; {r.seconds:.1f} s)")
        for label, text in (("claim", r.claim), ("measured", r.figure), ("why", r.reason)):
            lines.extend(textwrap.wrap(text, width=width, initial_indent=f"  {label + ':':<10}",
                                       subsequent_indent=" " * 12) or [f"  {label}:"])
    counts = ", ".join(f"{n} {v}" for v, n in verdict_counts(results).items())
    lines.append(f"{len(results)} claims: {counts}")
    return "\n".join(lines)


def claims_report(results: list[ClaimResult], ctx: ClaimContext | None = None) -> dict:
    """The JSON document of ``workbench claims --json``: the run's facts and one object per claim."""
    meta = {"format": "workbench-claims/1", "mode": ctx.mode if ctx else None, "machine": platform.machine(),
            "python": platform.python_version(), "sources": SOURCES, "counts": verdict_counts(results)}
    if ctx is not None and ctx._llm is not None:
        from workbench.bench.run_facts import run_facts

        meta.update(_jsonable(run_facts(ctx._llm, ctx._probe)))
    return {"meta": meta, "claims": [r.to_dict() for r in results], "problems": problems(results)}


def dumps(results: list[ClaimResult], ctx: ClaimContext | None = None) -> str:
    return json.dumps(claims_report(results, ctx), indent=2)
