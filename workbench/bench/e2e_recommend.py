"""The recommendation rule: which measured configuration to run for a stated SLO.

::

    rec = recommend(ab.candidates(), SLO(ttft_p95_ms=500, max_rel_ppl=0.02))
    rec["pick"], rec["reason"], rec["table"]        # None when no configuration meets the SLO
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workbench.errors import ConfigError
from workbench.measure.compare import compare_samples


@dataclass(frozen=True)
class SLO:
    """A service-level objective: P95 TTFT at most ``ttft_p95_ms`` in every run, a relative
    perplexity increase at most ``max_rel_ppl`` (configurations that keep the weights and exact
    attention count 0), optionally greedy agreement with the reference at least ``min_agreement``."""

    ttft_p95_ms: float
    max_rel_ppl: float = 0.02
    min_agreement: float | None = None

    def __post_init__(self) -> None:
        if not self.ttft_p95_ms > 0 or self.max_rel_ppl < 0:
            raise ConfigError(f"SLO: ttft_p95_ms must be > 0 and max_rel_ppl >= 0, got {self.ttft_p95_ms!r}, "
                              f"{self.max_rel_ppl!r}")

    def describe(self) -> str:
        s = f"P95 TTFT <= {self.ttft_p95_ms:g} ms in every run, perplexity +{100 * self.max_rel_ppl:g} % at most"
        return s + (f", greedy agreement >= {self.min_agreement:.0%}" if self.min_agreement is not None else "")


def recommend(rows: list[dict], slo: SLO, noise: float | None = None) -> dict:
    """The configuration to run for ``slo``, chosen from measured ``rows`` (:meth:`Ablation.candidates`:
    name, layers, per-run ``ttft_ms_p95`` and ``tokens_per_s``, ``rel_ppl``, ``agreement``,
    ``memory_bytes``).

    The rule: (1) a configuration meets the SLO when *every* run's P95 TTFT is within it (one
    that meets it only sometimes does not) and its quality is within the limits; (2) among those,
    the highest median throughput leads, and every other one whose throughput is within noise of
    it (:func:`compare_samples`, the same verdict rule as every comparison) ties with it; (3) of
    the tied, the one with the fewest layers wins, then the least memory.  No configuration
    meeting the SLO is a result too (``pick`` None), with the closest one named."""
    table = []
    for r in rows:
        why = []
        worst, med = max(r["ttft_ms_p95"]), float(np.median(r["ttft_ms_p95"]))
        if worst > slo.ttft_p95_ms:
            why.append(f"P95 TTFT {worst:.0f} ms in its slowest run > {slo.ttft_p95_ms:g} ms"
                       + (" (within it at the median: not in every run)" if med <= slo.ttft_p95_ms else ""))
        q = r.get("rel_ppl")
        if q is not None and q > slo.max_rel_ppl:
            why.append(f"perplexity {100 * q:+.2f} % > +{100 * slo.max_rel_ppl:g} %")
        a = r.get("agreement")
        if slo.min_agreement is not None and a is not None and a < slo.min_agreement:
            why.append(f"greedy agreement {a:.0%} < {slo.min_agreement:.0%}")
        table.append({"config": r["name"], "layers": len(r["layers"]), "ttft_ms_p95_worst": worst,
                      "ttft_ms_p95_median": med, "tokens_per_s_median": float(np.median(r["tokens_per_s"])),
                      "rel_ppl": q, "agreement": a, "memory_bytes": r.get("memory_bytes"), "meets": not why,
                      "why": "; ".join(why) or "meets the SLO"})
    ok = [r for r, t in zip(rows, table) if t["meets"]]
    if not ok:
        if not rows:
            return {"pick": None, "reason": "no configuration was measured", "table": table, "tied": []}
        closest = min(table, key=lambda t: t["ttft_ms_p95_worst"])
        return {"pick": None, "tied": [], "table": table,
                "reason": f"no configuration meets the SLO ({slo.describe()}); the closest is {closest['config']} "
                          f"({closest['why']})"}
    best = max(ok, key=lambda r: float(np.median(r["tokens_per_s"])))
    tied = [best] + [r for r in ok if r is not best and compare_samples(
        r["tokens_per_s"], best["tokens_per_s"], names=(r["name"], best["name"]), lower_is_better=False,
        noise=noise).winner is None]
    pick = min(tied, key=lambda r: (len(r["layers"]), r.get("memory_bytes") or 0, -float(np.median(r["tokens_per_s"]))))
    tps = float(np.median(pick["tokens_per_s"]))
    reason = (f"{pick['name']} meets the SLO ({slo.describe()}) with {tps:.0f} tokens/s; "
              + (f"highest throughput among the {len(ok)} that meet it"
                 if len(tied) == 1 else
                 f"{len(tied)} of the {len(ok)} that meet it are within noise of the highest throughput "
                 f"({best['name']}, {float(np.median(best['tokens_per_s'])):.0f} tokens/s): the one with the fewest "
                 f"layers, then the least memory, is chosen"))
    return {"pick": pick["name"], "reason": reason, "table": table, "tied": [r["name"] for r in tied]}
