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
   ``latency``, the fastest median - unless a mix whose decode steps are not slower beyond the
   noise (:func:`workbench.measure.compare.compare_samples`) degrades less beyond 2 standard
   errors, then the fastest of those: a speed-up nobody can measure does not justify a loss
   anyone can (and a quality difference within the noise does not justify a slower median).
2. **Confirm it once** on the confirmation text, which took no part in the pick: its figure
   there is the one reported.
3. **If it fails there**, the pick was within the limit by noise.  The fallbacks are the mixes
   within the limit *beyond 2 standard errors* on the search text, picked the same way one after
   the other; from the second look at the confirmation text on, a fallback must also be within the
   limit beyond 2 standard errors *there* (each look is another chance for noise to pass a mix, so
   each later look asks for the margin).  The unquantized model ends the list (degradation 0
   everywhere).  ``tries`` lists every mix measured on the confirmation text, in order: with more
   than one, the result says so.
"""

from __future__ import annotations

from collections.abc import Callable

from workbench.measure.compare import compare_samples

UNQUANTIZED = "unquantized"


def _pick(rows: list[dict], objective: str, noise: float | None = None) -> dict:
    if objective == "memory":
        return min(rows, key=lambda r: (r["cost"], r["degradation"]))

    fastest = min(rows, key=lambda r: (r["cost"], r["degradation"]))
    # mixes the fastest does not beat beyond the noise, and whose quality beats the fastest's
    # beyond 2 standard errors: a measured gain in quality for an unmeasurable loss in speed
    better = [r for r in rows
              if r is not fastest and r["degradation"] + 2 * r["degradation_se"] < fastest["degradation"]
              and compare_samples(fastest["samples"], r["samples"], names=("fastest", "other"),
                                  noise=noise).winner is None]
    return min(better, key=lambda r: (r["cost"], r["degradation"])) if better else fastest


def recommend(candidates: list[dict], confirm: Callable[[dict], tuple[float, float]], limit: float,
              objective: str, noise: float | None = None) -> tuple[dict, list[dict]]:
    """``(recommended row, tries)``: the rule of the module docstring; every tried row gets
    ``confirmation_degradation`` / ``_se`` and ``confirmed``; ``tries`` lists them in order."""
    unq = next(r for r in candidates if r["key"] == UNQUANTIZED)
    unq.update(confirmation_degradation=0.0, confirmation_degradation_se=0.0, confirmed=True)
    tries: list[dict] = []

    def look(row: dict) -> bool:
        if row is unq:
            return True
        d, se = confirm(row)
        # the first look tests the pick; every later one asks for the margin (see the docstring)
        ok = d <= limit if not tries else d + 2 * se <= limit
        row.update(confirmation_degradation=d, confirmation_degradation_se=se, confirmed=ok)
        tries.append(row)
        return ok

    first = _pick([r for r in candidates if r["degradation"] <= limit], objective, noise)
    if look(first):
        return first, tries
    pool = [r for r in candidates if r["degradation"] + 2 * r["degradation_se"] <= limit and r is not first]
    while pool:
        row = _pick(pool, objective, noise)
        if look(row):
            return row, tries
        pool = [r for r in pool if r is not row]
    return unq, tries
