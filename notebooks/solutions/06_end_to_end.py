"""Solutions to notebook 06's exercise (workbench exercises list 06)."""

import statistics

from workbench.measure.compare import compare_samples   # the noise rule every comparison uses


def pick(rows: list[dict], ttft_p95_ms: float, max_rel_ppl: float, noise: float) -> str | None:
    """The name of the configuration to recommend for the SLO, or None when none meets it."""
    meets = [r for r in rows
             if max(r["ttft_ms_p95"]) <= ttft_p95_ms and (r["rel_ppl"] is None or r["rel_ppl"] <= max_rel_ppl)]
    if not meets:
        return None
    leader = max(meets, key=lambda r: statistics.median(r["tokens_per_s"]))
    tied = [leader] + [r for r in meets if r is not leader and compare_samples(
        r["tokens_per_s"], leader["tokens_per_s"], names=(r["name"], leader["name"]), noise=noise,
        lower_is_better=False).winner is None]
    best = min(tied, key=lambda r: (len(r["layers"]), r["memory_bytes"] or 0, -statistics.median(r["tokens_per_s"])))
    return best["name"]
