"""The serving claims' decision rules: pure functions of measured samples, unit-tested on synthetic
ones (``tests/bench/test_claims_serving.py``), both outcomes.

* :func:`compare_statistic`: bootstrap intervals of a statistic (the standard deviation of TTFT) of
  two samples, separated beyond the noise floor or not; :func:`detectable_ratio`: how large an
  effect a comparison could have seen;
* :func:`load_knee`, :func:`closed_loop_power`, :func:`sweet_spot`: where latency turns under load;
* :class:`ErrorRateBreaker`, :func:`degradation_onset`: an error-rate breaker against a slow
  degradation;
* :func:`idle_fraction`: the engine's idle share between steps; :func:`sse_report`: the bytes of
  a stream's chunks and events.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable


def sample_sd(values) -> float:
    """The sample standard deviation (ddof 1), as :func:`workbench.engine.metrics.jitter` defines it."""
    from workbench.engine.metrics import jitter

    return jitter(values)


def compare_statistic(a, b, stat: Callable = sample_sd, names: tuple[str, str] = ("A", "B"), resamples: int = 2000,
                      confidence: float = 0.9, seed: int = 0, noise: float | None = None, **kw):
    """:func:`~workbench.measure.compare.compare_quantile` for any statistic of one set of values a
    side (the standard deviation of TTFT, a mean): a seeded bootstrap ``confidence`` interval of
    ``stat`` per side; the verdict needs the intervals apart and the ratio of the point estimates
    beyond ``1 + noise`` (the same :class:`~workbench.measure.compare.Comparison` rules).  Needs at
    least 5 values a side."""
    import numpy as np

    from workbench.measure.compare import Comparison

    vals = {names[0]: [float(v) for v in a], names[1]: [float(v) for v in b]}
    for n, v in vals.items():
        if len(v) < 5:
            raise ValueError(f"compare_statistic: side {n!r} has {len(v)} values; need at least 5")
    rng = np.random.default_rng(seed)
    lo_q, hi_q = (1 - confidence) / 2, 1 - (1 - confidence) / 2
    est, ivl = {}, {}
    for n, v in vals.items():
        arr = np.asarray(v)
        boot = [stat(arr[idx]) for idx in rng.integers(0, arr.size, size=(resamples, arr.size))]
        est[n] = float(stat(arr))
        ivl[n] = (float(np.quantile(boot, lo_q)), float(np.quantile(boot, hi_q)))
    return Comparison(names=tuple(names), samples=vals, noise=noise, estimate=est, interval=ivl,
                      confidence=confidence, **kw)


def detectable_ratio(cmp, worse: str | None = None) -> float:
    """The smallest worse / better ratio this comparison would have called a difference: the
    noise floor, or what it takes to pull the sides' ranges (or bootstrap intervals) apart when
    ``worse`` is the slower one - the larger of the two.  ``worse``: the side the claim says is
    worse (default: the one measured worse)."""
    a, b = cmp.names
    if worse is None:
        worse = cmp._better_first()[1]
    better = b if worse == a else a
    (blo, bhi), (wlo, whi) = cmp.spread(better), cmp.spread(worse)
    if cmp.lower_is_better:
        apart = bhi / wlo if wlo > 0 else math.inf    # scale the worse side up until its lowest clears
    else:
        apart = whi / blo if blo > 0 else math.inf
    # the sides' own ranges, as if no difference: any effect within them cannot separate
    span = max(bhi / blo if blo > 0 else math.inf, whi / wlo if wlo > 0 else math.inf)
    return max(1 + cmp.noise, min(max(apart, 1.0), span) if math.isfinite(span) else apart)


def load_knee(rates: list[float], comparisons: list) -> float | None:
    """The first offered rate whose latency percentile is higher than the lowest rate's beyond the
    noise (``comparisons[i]``: lowest rate vs ``rates[i]``, the lowest rate's name first), or None
    when no rate of the sweep is (a flat curve)."""
    for r, cmp in zip(rates, comparisons):
        if cmp is not None and cmp.winner == cmp.names[0]:
            return r
    return None


def closed_loop_power(values) -> float:
    """Kleinrock's power (throughput / latency, in requests/s per second) of a closed loop from its
    requests' E2E in ms divided by the square root of the number of users (``E2E_ms / sqrt(users)``):
    with no think time Little's law gives throughput ``users / R``, so power = ``users / R**2``."""
    m = sum(values) / len(values)
    return 1e6 / (m * m) if m > 0 else math.inf


def sweet_spot(levels: list[int], latency: dict, noise: float) -> dict:
    """The sweet spot of a closed-loop concurrency sweep (``latency[c]``: the E2E in ms of each
    request run at ``c`` users, no think time): the concurrency with the highest *power*,
    throughput / latency (Kleinrock's optimal operating point: below it more users buy throughput at
    little latency, past it they buy latency and little throughput).  Throughput per level by
    Little's law, ``c / mean E2E``.  ``found``: the best power is at a level below the largest one
    and beats the largest level's beyond the noise (bootstrap intervals, :func:`compare_statistic`);
    ``latency_rises``: P95 latency at the largest level is higher than at the sweet spot beyond the
    noise (bootstrap intervals of P95)."""
    from workbench.measure.compare import compare_quantile

    levels = sorted(levels)
    scaled = {c: [v / math.sqrt(c) for v in latency[c]] for c in levels if len(latency.get(c, [])) >= 5}
    usable = [c for c in levels if c in scaled]
    empty = {"best": None, "sweet_spot": None, "found": False, "latency_rises": False, "power_comparison": None,
             "latency_comparison": None, "throughput": {}, "power": {}}
    if not usable:
        return {**empty, "why": "fewer than 5 completed requests at every level"}
    mean = {c: statistics.mean(latency[c]) for c in usable}
    tput = {c: c * 1e3 / mean[c] for c in usable}
    power = {c: closed_loop_power(scaled[c]) for c in usable}
    star = max(usable, key=lambda c: power[c])
    best = max(usable, key=lambda c: tput[c])
    top = levels[-1]
    pw = lat = None
    why = None
    if star >= top:
        why = f"throughput / latency is highest at the largest level ({top} users)"
    elif top not in scaled:
        why = f"fewer than 5 completed requests at {top} users"
    else:
        pw = compare_statistic(scaled[star], scaled[top], stat=closed_loop_power,
                               names=(f"{star} users", f"{top} users"), noise=noise, lower_is_better=False,
                               metric="throughput / latency", better_word="higher")
        lat = compare_quantile(latency[star], latency[top], q=0.95, names=(f"{star} users", f"{top} users"),
                               noise=noise, metric="E2E P95", unit="ms")
        if pw.winner != pw.names[0]:
            why = f"throughput / latency at {top} users is within noise of the best ({pw.verdict})"
    found = pw is not None and pw.winner == pw.names[0]
    rises = lat is not None and lat.winner == lat.names[0]
    return {"best": best, "sweet_spot": star, "found": found, "latency_rises": rises, "power_comparison": pw,
            "latency_comparison": lat, "throughput": tput, "power": power, "why": why}


class ErrorRateBreaker:
    """The breaker the article replaces: open when the share of failed requests among the last
    ``window`` (at least ``min_samples`` seen) exceeds ``threshold`` (A §4.2's old rule:
    ``error_rate > 5 %``).  ``record(failed, now)`` returns whether it is open."""

    def __init__(self, threshold: float = 0.05, window: int = 20, min_samples: int = 10) -> None:
        from collections import deque

        self.threshold, self.min_samples = threshold, min_samples
        self.recent = deque(maxlen=window)
        self.opened_at: float | None = None
        self.seen = 0

    def record(self, failed: bool, now: float) -> bool:
        self.seen += 1
        self.recent.append(bool(failed))
        if self.opened_at is None and len(self.recent) >= self.min_samples \
                and sum(self.recent) / len(self.recent) > self.threshold:
            self.opened_at = now
        return self.opened_at is not None

    @property
    def open(self) -> bool:
        return self.opened_at is not None


def degradation_onset(steps, since: float, until: float | None, share: float = 0.75) -> float | None:
    """When requests began to wait for good: the earliest step start ``t`` in ``[since, until]`` with
    requests waiting after it, such that from ``t`` to ``until`` at least ``share`` of the steps
    left requests waiting (``steps``: step records with ``start`` and ``waiting``; a queue that
    empties for a step now and then still counts as full).  None when no such stretch exists."""
    rows = [(st["start"], st["waiting"]) if isinstance(st, dict) else (st.start, st.waiting) for st in steps]
    rows = [(t, w) for t, w in rows if t >= since and (until is None or t <= until)]
    onset, waiting = None, 0
    for total, (t, w) in enumerate(reversed(rows), 1):   # from the end: the share of waiting steps from t on
        waiting += w > 0
        if w > 0 and waiting >= share * total:
            onset = t
    return onset


def idle_fraction(steps) -> dict:
    """Of the time requests were in the engine, the share in which it computed nothing although
    requests were waiting (the micro-batch window holding them): from an engine's step records
    (``steps_frame``: a step with ``num_seqs == 0`` and ``waiting > 0`` lasts until the next
    step starts).  Returns idle and busy seconds and the fraction."""
    rows = steps.sort_values("start").to_dict("records") if hasattr(steps, "to_dict") else list(steps)
    idle = busy = 0.0
    for r, nxt in zip(rows, rows[1:] + [None]):
        if r["num_seqs"] > 0:
            busy += r["schedule_s"] + r["model_s"] + r["post_s"]
        elif r["waiting"] > 0 and nxt is not None:
            idle += nxt["start"] - r["start"]
    total = idle + busy
    return {"idle_s": idle, "busy_s": busy, "idle_fraction": idle / total if total > 0 else 0.0}


def sse_report(chunks: list[bytes]) -> dict:
    """What a client sees of one SSE body read chunk by chunk (``chunks``: the pieces as they came
    off the connection): the first chunk's size, each event's size (``data: ...`` up to its blank
    line), how many chunks were not exactly one whole event, whether line-by-line parsing
    (``readline()``: split at ``\\n``) gives every ``data:`` line as complete JSON, and how many
    events a client reading fixed 64-byte pieces (A §3.2's ``read(64)``) would cut."""
    body = b"".join(chunks)
    events = [e for e in body.split(b"\n\n") if e.strip()]
    sizes = [len(e) + 2 for e in events]
    whole = sum(1 for c in chunks if c.endswith(b"\n\n") and c.count(b"\n\n") == 1 and c.startswith(b"data:"))
    lines = [ln for ln in body.split(b"\n") if ln.startswith(b"data:")]
    parsed = 0
    for ln in lines:
        data = ln[5:].strip()
        if data == b"[DONE]":
            parsed += 1
            continue
        try:
            json.loads(data)
            parsed += 1
        except ValueError:
            pass
    # read(64): fixed pieces; an event is cut when a piece boundary falls inside it
    cut, pos = 0, 0
    for s in sizes:
        start, end = pos, pos + s
        if start // 64 != (end - 1) // 64 or s > 64:
            cut += 1
        pos = end
    return {"chunks": len(chunks), "first_chunk_bytes": len(chunks[0]) if chunks else 0,
            "chunk_bytes": [len(c) for c in chunks], "events": len(events), "event_bytes": sizes,
            "first_event_bytes": sizes[0] if sizes else 0, "chunks_one_whole_event": whole,
            "data_lines": len(lines), "lines_parsed_whole": parsed, "events_cut_by_read64": cut}
