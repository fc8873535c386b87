"""The calibrator's recommendation rule, apart from everything it measures (so it can be read and
tested on its own).

::

    best, tries = recommend(candidates, confirm, limit, objective="memory")

``candidates``: measured mixes, each a dict with ``key``, ``degradation`` / ``degradation_se``
(on the *search* text), ``cost`` (bytes, or decode ms) and, for latency, ``samples`` (one per
interleaved round); the unquantized model is one of them (``key == "unquantized"``, degradation
0).  ``confirm(row) -> (degradation, se)`` measures a mix on the *confirmation* text.

1. **Pick on the search text.** Among mixes within the limit there (point estimate): for
   ``memory``, the fewest bytes (exact, so no noise; ties to the lower degradation); for
   ``latency``, the fastest median *and every mix whose decode steps are not slower beyond the
   noise* (:func:`workbench.measure.compare.compare_samples`), and of those the lowest
   degradation - a speed-up nobody can measure does not justify a loss anyone can.
2. **Confirm it once** on the confirmation text, which took no part in the pick: its figure
   there is the one reported.
3. **If it fails there**, the pick was within the limit by noise.  The fallback is picked the same
   way among the mixes within the limit *beyond 2 standard errors* on the search text, and
   confirmed; having looked at the confirmation text twice, its figure is a little optimistic,
   and the result says so (``tries``).  If that fails too, the unquantized model.
"""

from __future__ import annotations

from typing import Callable

UNQUANTIZED = "unquantized"


def _pick(rows: list[dict], objective: str, noise: float | None = None) -> dict:
    if objective == "memory":
        return min(rows, key=lambda r: (r["cost"], r["degradation"]))
    from workbench.measure.compare import compare_samples

    fastest = min(rows, key=lambda r: (r["cost"], r["degradation"]))
    tied = [r for r in rows if r is fastest or
            compare_samples(fastest["samples"], r["samples"], names=("fastest", "other"), noise=noise).winner is None]
    return min(tied, key=lambda r: (r["degradation"], r["cost"]))


def recommend(candidates: list[dict], confirm: Callable[[dict], tuple[float, float]], limit: float,
              objective: str, noise: float | None = None) -> tuple[dict, list[dict]]:
    """``(recommended row, tries)``: the rule of the module docstring; every tried row gets
    ``confirmation_degradation`` / ``_se`` and ``confirmed``; ``tries`` lists them in order."""
    unq = next(r for r in candidates if r["key"] == UNQUANTIZED)
    tries: list[dict] = []

    def attempt(pool: list[dict]) -> dict | None:
        pool = [r for r in pool if r not in tries]
        if not pool:
            return None
        row = _pick(pool, objective, noise)
        if row is unq:
            row.update(confirmation_degradation=0.0, confirmation_degradation_se=0.0, confirmed=True)
            return row
        d, se = confirm(row)
        row.update(confirmation_degradation=d, confirmation_degradation_se=se, confirmed=d <= limit)
        tries.append(row)
        return row if row["confirmed"] else None

    first = attempt([r for r in candidates if r["degradation"] <= limit])
    if first is not None:
        return first, tries
    second = attempt([r for r in candidates if r["degradation"] + 2 * r["degradation_se"] <= limit])
    if second is not None:
        return second, tries
    unq.update(confirmation_degradation=0.0, confirmation_degradation_se=0.0, confirmed=True)
    return unq, tries
