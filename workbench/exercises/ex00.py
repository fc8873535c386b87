"""Notebook 00's exercises: latency metrics from raw timestamps."""

from __future__ import annotations

import numpy as np

from workbench.engine.metrics import RequestMetrics
from workbench.exercises.core import Case, Exercise, compare_values


def _latencies(arrival: float, token_times: list[float], finished: float) -> dict:
    m = RequestMetrics(arrival_time=arrival, first_token_time=token_times[0] if token_times else None,
                       token_times=list(token_times), finished_time=finished)
    return {"ttft": m.ttft, "tpot": m.tpot, "e2e": m.e2e}


def _latency_cases() -> list[Case]:
    return [Case("three tokens", dict(arrival=10.0, token_times=[10.5, 10.6, 10.8], finished=10.8)),
            Case("one token: no time per output token", dict(arrival=0.0, token_times=[0.25], finished=0.25)),
            Case("no token at all (the request failed before its first)",
                 dict(arrival=1.0, token_times=[], finished=1.5)),
            Case("the first token at the arrival instant", dict(arrival=2.0, token_times=[2.0, 2.5], finished=2.5)),
            Case("finished after the last token (detokenizing, streaming out)",
                 dict(arrival=0.0, token_times=[0.1, 0.2, 0.3], finished=0.45))]


def _latency_strategy():
    from hypothesis import strategies as st

    gaps = st.lists(st.floats(0.0, 0.5, allow_nan=False), min_size=0, max_size=12)

    @st.composite
    def kw(draw):
        arrival = draw(st.floats(0.0, 100.0, allow_nan=False))
        first = draw(st.floats(0.0, 2.0, allow_nan=False))
        g = draw(gaps)
        times = [arrival + first + sum(g[:i]) for i in range(len(g) + 1)] if draw(st.booleans()) or g else []
        tail = draw(st.floats(0.0, 0.1, allow_nan=False))
        return dict(arrival=arrival, token_times=times, finished=(times[-1] if times else arrival + first) + tail)
    return kw()


def _latency_compare(kw: dict, got, expected) -> str | None:
    if not isinstance(got, dict):
        return f"expected a dict with keys 'ttft', 'tpot', 'e2e', got {type(got).__name__}"
    msg = compare_values(got, expected, rel=1e-9, abs_=1e-9)
    if msg is None:
        return None
    n = len(kw["token_times"])
    why = {"'ttft'": "TTFT is the first token's time minus the arrival (queueing counts: the user waited)"
                     + ("; with no token there is no TTFT: None" if n == 0 else ""),
           "'tpot'": "TPOT is the mean gap between output tokens: (last - first) / (n - 1); the first token "
                     "is not counted (it is the prefill's)" + ("; with fewer than 2 tokens: None" if n < 2 else ""),
           "'e2e'": "E2E is the finish time minus the arrival"}
    for key, rule in why.items():
        if msg.startswith(key):
            return f"{msg}\n{rule}"
    return msg


def _percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def _percentile_cases() -> list[Case]:
    return [Case("one value", dict(values=[7.0], q=95)),
            Case("two values: P95 lies between them", dict(values=[1.0, 2.0], q=95)),
            Case("unsorted input", dict(values=[30.0, 10.0, 20.0, 40.0], q=50)),
            Case("q = 100 is the maximum", dict(values=[3.0, 1.0, 2.0], q=100)),
            Case("q = 0 is the minimum", dict(values=[3.0, 1.0, 2.0], q=0)),
            Case("twenty values (the 19th and 20th)", dict(values=[float(i) for i in range(1, 21)], q=95)),
            Case("no values", dict(values=[], q=95))]


def _percentile_strategy():
    from hypothesis import strategies as st

    return st.fixed_dictionaries({"values": st.lists(st.floats(0.0, 1e4, allow_nan=False), min_size=0, max_size=40),
                                  "q": st.sampled_from([0, 25, 50, 90, 95, 99, 100])})


def _percentile_compare(kw: dict, got, expected) -> str | None:
    msg = compare_values(got, expected, rel=1e-9, abs_=1e-9)
    if msg is None:
        return None
    n = len(kw["values"])
    if n == 0:
        return f"{msg}\nwith no values there is no percentile: return None"
    pos = (n - 1) * kw["q"] / 100
    return (f"{msg}\nthe {kw['q']}th percentile of {n} sorted values sits at position (n - 1) * q / 100 = {pos:g}: "
            f"between sorted values {int(pos)} and {min(int(pos) + 1, n - 1)}, linearly (numpy's default)")


EXERCISES = [
    Exercise(
        id="00.latencies", notebook="00_tour", title="TTFT, TPOT and E2E from raw timestamps",
        teaches="what each latency a serving benchmark reports measures, and where its clock starts",
        statement=(
            "A request arrives at `arrival` (seconds), its output tokens reach the client at `token_times`, and it "
            "finishes at `finished`. Return a dict with `ttft` (time to the first token, from the arrival), `tpot` "
            "(time per output token after the first) and `e2e` (arrival to finish), in seconds. A latency that "
            "does not exist for this request (no token yet, or a single token for TPOT) is `None`."),
        hints=["Every latency the user sees starts at the arrival, not when the request was scheduled: a request "
               "that waited in the queue waited.",
               "TPOT leaves the first token out: it is the prefill's. With `n` tokens there are `n - 1` gaps.",
               "`tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1)` when there are at least two "
               "tokens; `ttft = token_times[0] - arrival` when there is one."],
        stub=('def latencies(arrival: float, token_times: list[float], finished: float) -> dict:\n'
              '    """{"ttft": ..., "tpot": ..., "e2e": ...} in seconds; None where a latency does not exist."""\n'
              '    # your code here\n'
              '    raise NotImplementedError'),
        reference=_latencies, cases=_latency_cases, strategy=_latency_strategy, compare=_latency_compare,
        plugs_into="the latency table of section 4: your TTFT and TPOT beside the engine's own, per request"),
    Exercise(
        id="00.percentile", notebook="00_tour", title="P95 of a latency",
        teaches="what a tail percentile is, and why P95 of few samples interpolates",
        statement=(
            "Return the `q`-th percentile (0-100) of `values`, by linear interpolation between the two nearest "
            "sorted values (numpy's default, and what every table of this workbench reports). No values: `None`."),
        hints=["Sort first. With `n` values the percentile sits at position `(n - 1) * q / 100` of the sorted list.",
               "That position is usually not a whole number: take the values at `floor(pos)` and `floor(pos) + 1` "
               "and interpolate between them with the fractional part.",
               "`lo = int(pos); frac = pos - lo; result = s[lo] + (s[min(lo + 1, n - 1)] - s[lo]) * frac`"],
        stub=('def percentile(values: list[float], q: float) -> float | None:\n'
              '    """The q-th percentile (0-100), linearly interpolated; None for no values."""\n'
              '    # your code here (without numpy)\n'
              '    raise NotImplementedError'),
        reference=_percentile, cases=_percentile_cases, strategy=_percentile_strategy, compare=_percentile_compare,
        plugs_into="the same table: P50 and P95 over the requests, with your percentile"),
]
