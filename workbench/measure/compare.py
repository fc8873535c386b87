"""Noise-aware A/B comparisons: interleaved repeats, medians, spreads, and a verdict only beyond them.

One run per side proves nothing on a shared machine: a background process, a frequency change
or a page-cache miss can move a single timing by 2-10x.  So every comparison in the workbench
goes through this module::

    cmp = compare({"off": lambda: run(cache=False), "on": lambda: run(cache=True)},
                  repeats=3, metric="TTFT p50", unit="ms", key=lambda r: r["ttft_ms_p50"])
    cmp.verdict          # 'on lower by 6.8x'  or  'within noise (1.04x, ranges overlap)'
    cmp.results["on"]    # whatever each call returned, in call order (tokens, tables ...)

**How the runs are ordered.** Round ``r`` runs the sides in order on even rounds and reversed on
odd ones (A B, B A, A B, ...), so slow drift and "second run is warmer" effects hit both.

**When a verdict is stated.** Side X is called better only when

1. with at least 3 samples a side, every one of its samples beats every sample of the other
   side (the ranges do not overlap: chance alone does that 1 time in 10 with 3 a side, 1 in 126
   with 5; with 1 or 2 a side it proves nothing, so no verdict is stated), **or**, with
   at least 6 rounds, it won every round against the run next to it (paired: slow drift over
   the whole run cannot fake that; chance alone does it 1 time in 32 with 6 rounds), and
2. the ratio of the medians exceeds ``1 + noise``, the machine's noise level measured by
   :func:`workbench.measure.probe.noise_probe` (or a floor given by the caller).

Otherwise the verdict is ``within noise``.  The ratio is always reported as *worse / better*
(>= 1), with the range of the per-round ratios next to it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any
from collections.abc import Callable

from workbench.measure.probe import last_probe, noise_probe

WITHIN_NOISE = "within noise"
MIN_SEPARATED_SAMPLES = 3
MIN_PAIRED_ROUNDS = 6


@dataclass
class Comparison:
    """Samples of two sides and what may be concluded from them."""

    names: tuple[str, str]
    samples: dict[str, list[float]]
    metric: str = "time"
    unit: str = ""
    lower_is_better: bool = True
    noise: float | None = None              # relative noise floor: ratios below 1 + noise are not verdicts
                                            # (None: the last noise probe of this process; one runs if none has)
    better_word: str | None = None          # "lower", "faster", "higher" ... (default from lower_is_better)
    confidence: float = 0.9                 # of the bootstrap intervals (compare_quantile)
    results: dict[str, list[Any]] = field(default_factory=dict)   # what each call returned
    # set by compare_quantile: a point estimate and a bootstrap interval per side, used instead of
    # the median and the min..max of the samples
    estimate: dict[str, float] | None = None
    interval: dict[str, tuple[float, float]] | None = None

    def __post_init__(self) -> None:
        a, b = self.names
        if a == b:
            raise ValueError(f"compare: the two sides need different names, got {a!r} twice")
        for n in self.names:
            s = self.samples.get(n)
            if not s:
                raise ValueError(f"compare: side {n!r} has no samples")
            if any(v is None or v != v for v in s):
                raise ValueError(f"compare: side {n!r} has a missing or NaN sample: {s}")
        if self.noise is None:
            self.noise = _default_noise()
        if self.noise < 0:
            raise ValueError(f"compare: noise must be >= 0, got {self.noise}")

    # ---- per side ---------------------------------------------------------------------------
    def median(self, name: str) -> float:
        """The side's central value: the median of its samples (or the bootstrap point estimate)."""
        if self.estimate is not None:
            return self.estimate[name]
        return statistics.median(self.samples[name])

    def spread(self, name: str) -> tuple[float, float]:
        """min..max of the samples (or the bootstrap interval)."""
        if self.interval is not None:
            return tuple(self.interval[name])
        s = self.samples[name]
        return min(s), max(s)

    # ---- the comparison ---------------------------------------------------------------------
    def _better_first(self) -> tuple[str, str]:
        a, b = self.names
        ma, mb = self.median(a), self.median(b)
        a_better = ma <= mb if self.lower_is_better else ma >= mb
        return (a, b) if a_better else (b, a)

    @property
    def ratio(self) -> float:
        """Median of the worse side over the median of the better one (>= 1); inf when the
        better side's median is 0 for a lower-is-better metric."""
        best, worst = self._better_first()
        mb, mw = self.median(best), self.median(worst)
        num, den = (mw, mb) if self.lower_is_better else (mb, mw)
        if den == 0:
            return float("inf") if num > 0 else 1.0
        return num / den

    @property
    def round_ratios(self) -> list[float]:
        """Worse / better within each round (paired samples), as far as both sides have one."""
        if self.interval is not None:      # bootstrap samples are not paired runs
            return []
        best, worst = self._better_first()
        out = []
        for vb, vw in zip(self.samples[best], self.samples[worst]):
            num, den = (vw, vb) if self.lower_is_better else (vb, vw)
            out.append(num / den if den else float("inf"))
        return out

    @property
    def enough(self) -> bool:
        """Enough samples for the range rule (a bootstrap comparison checked its own size)."""
        return self.interval is not None or min(len(self.samples[n]) for n in self.names) >= MIN_SEPARATED_SAMPLES

    @property
    def separated(self) -> bool:
        """Every sample of the better side beats every sample of the other (with enough samples)."""
        if not self.enough:
            return False
        best, worst = self._better_first()
        (blo, bhi), (wlo, whi) = self.spread(best), self.spread(worst)
        return bhi < wlo if self.lower_is_better else blo > whi

    @property
    def paired(self) -> bool:
        """The better side won every round, over at least ``MIN_PAIRED_ROUNDS`` rounds."""
        rr = self.round_ratios
        return len(rr) >= MIN_PAIRED_ROUNDS and all(r > 1 for r in rr)

    @property
    def winner(self) -> str | None:
        """The better side, or None when the difference is within noise."""
        if (self.separated or self.paired) and self.ratio > 1 + self.noise:
            return self._better_first()[0]
        return None

    @property
    def verdict(self) -> str:
        w = self.winner
        word = self.better_word or ("lower" if self.lower_is_better else "higher")
        if w is not None:
            return f"{w} {word} by {self.ratio:.2f}x"
        if not self.enough:
            n = min(len(self.samples[x]) for x in self.names)
            why = f"{n} run{'s' if n > 1 else ''} a side: too few for a verdict"
        elif not (self.separated or self.paired):
            why = "ranges overlap"
        else:
            why = f"below the {self.noise:.0%} noise floor"
        return f"{WITHIN_NOISE} ({self.ratio:.2f}x, {why})"

    def favours(self, name: str) -> bool:
        """True when the verdict names ``name`` the better side."""
        return self.winner == name

    def describe(self) -> str:
        """One line: each side's median [min..max], the verdict."""
        u = f" {self.unit}" if self.unit else ""
        sides = "; ".join(f"{n} {_fmt(self.median(n))}{u} [{_fmt(self.spread(n)[0])}..{_fmt(self.spread(n)[1])}]"
                          for n in self.names)
        n = min(len(self.samples[x]) for x in self.names)
        how = (f"bootstrap {self.confidence:.0%} intervals over {n}+ values" if self.interval is not None
               else f"{n} runs each, interleaved")
        return f"{self.metric}: {sides} ({how}) -> {self.verdict}"

    def as_dict(self) -> dict:
        """JSON-ready: samples, medians, spreads, ratio, verdict (no raw results)."""
        rr = self.round_ratios or [self.ratio]
        return {"metric": self.metric, "unit": self.unit, "lower_is_better": self.lower_is_better,
                "noise": self.noise, "samples": {n: list(self.samples[n]) for n in self.names},
                "median": {n: self.median(n) for n in self.names},
                "min": {n: self.spread(n)[0] for n in self.names}, "max": {n: self.spread(n)[1] for n in self.names},
                "ratio": self.ratio, "round_ratio_min": min(rr), "round_ratio_max": max(rr),
                "separated": self.separated, "paired": self.paired,
                "winner": self.winner, "verdict": self.verdict}

    def row(self) -> dict:
        """A flat row for tables: the metric, both medians and spreads, the ratio and verdict."""
        out = {"metric": self.metric}
        for n in self.names:
            lo, hi = self.spread(n)
            out[f"{n} median"], out[f"{n} min"], out[f"{n} max"] = self.median(n), lo, hi
        out["ratio"], out["verdict"] = self.ratio, self.verdict
        return out

    def __str__(self) -> str:
        return self.describe()


def _fmt(v: float) -> str:
    a = abs(v)
    return f"{v:.3g}" if a < 10 else f"{v:.1f}" if a < 1000 else f"{v:,.0f}"


def _default_noise() -> float:
    """The last :func:`~workbench.measure.probe.noise_probe` of this process; a probe now if none ran."""
    probe = last_probe() or noise_probe()
    return probe.threshold


def compare_samples(a: list[float], b: list[float], names: tuple[str, str] = ("A", "B"), noise: float | None = None,
                    **kw) -> Comparison:
    """A :class:`Comparison` of samples measured elsewhere (they should have been interleaved).
    ``noise``: the relative noise floor; by default the last noise probe of this process (one
    runs now, in about a tenth of a second, when none has)."""
    return Comparison(names=tuple(names), samples={names[0]: list(a), names[1]: list(b)}, noise=noise, **kw)


def compare_quantile(a: list[float], b: list[float], q: float = 0.95, names: tuple[str, str] = ("A", "B"),
                     resamples: int = 2000, confidence: float = 0.9, seed: int = 0, noise: float | None = None,
                     **kw) -> Comparison:
    """Compare a percentile (e.g. P95 TTFT) of two sets of values from one run each.

    One load run per side gives many requests but one P95, so its spread comes from the
    requests themselves: a seeded bootstrap (``resamples`` resamples with replacement) gives a
    ``confidence`` interval of each side's percentile; a verdict needs the two intervals apart
    and the ratio of the estimates above ``1 + noise``.  Needs at least 5 values a side.
    """
    import numpy as np  # lazy: this module imports no numpy / torch (torch-free callers: recommend, the CLI)

    if not 0 < q < 1:
        raise ValueError(f"compare_quantile: q must be in (0, 1), got {q}")
    vals = {names[0]: [float(v) for v in a], names[1]: [float(v) for v in b]}
    for n, v in vals.items():
        if len(v) < 5:
            raise ValueError(f"compare_quantile: side {n!r} has {len(v)} values; need at least 5")
    rng = np.random.default_rng(seed)
    est, ivl = {}, {}
    lo_q, hi_q = (1 - confidence) / 2, 1 - (1 - confidence) / 2
    for n, v in vals.items():
        arr = np.asarray(v)
        boot = np.quantile(rng.choice(arr, size=(resamples, arr.size), replace=True), q, axis=1)
        est[n] = float(np.quantile(arr, q))
        ivl[n] = (float(np.quantile(boot, lo_q)), float(np.quantile(boot, hi_q)))
    return Comparison(names=tuple(names), samples=vals, noise=noise, estimate=est, interval=ivl,
                      confidence=confidence, **kw)


def compare(sides: dict[str, Callable[[], Any]], repeats: int = 3, warmup: int = 0,
            key: Callable[[Any], float] | None = None, noise: float | None = None, **kw) -> Comparison:
    """Run two sides ``repeats`` times each, interleaved (A B, B A, ...), and compare.

    ``sides``: two named callables.  Each call returns a number, or anything from which ``key``
    extracts the number; everything returned is kept in ``Comparison.results``.  ``warmup``
    rounds run both sides first and are discarded.  ``noise``: the relative noise floor (by
    default the last :func:`~workbench.measure.probe.noise_probe` of this process; one runs now
    when none has).
    Other keyword arguments go to :class:`Comparison` (``metric``, ``unit``, ``lower_is_better``,
    ``better_word``).
    """
    if len(sides) != 2:
        raise ValueError(f"compare: give exactly two sides, got {list(sides)}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"compare: repeats must be an integer >= 1, got {repeats!r}")
    names = tuple(sides)
    key = key or (lambda v: float(v))
    for _ in range(warmup):
        for n in names:
            sides[n]()
    samples: dict[str, list[float]] = {n: [] for n in names}
    results: dict[str, list[Any]] = {n: [] for n in names}
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            value = sides[n]()
            results[n].append(value)
            v = key(value)
            if v is None:
                raise ValueError(f"compare: side {n!r}, run {r + 1}: the measured value is None")
            samples[n].append(float(v))
    return Comparison(names=names, samples=samples, noise=noise, results=results, **kw)


__all__ = ["Comparison", "compare", "compare_samples", "compare_quantile", "WITHIN_NOISE", "MIN_PAIRED_ROUNDS",
           "MIN_SEPARATED_SAMPLES"]
