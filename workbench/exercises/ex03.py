"""Notebook 03's exercises: weight streaming's prefetch schedule, and the stall no schedule can hide."""

from __future__ import annotations

import math

from workbench.bench.prefetch_streaming import ideal_times as _package_ideal_times
from workbench.exercises.core import Case, Exercise, compare_values, show
from workbench.prefetch.weights import next_fetch as _package_next_fetch
from workbench.prefetch.weights import stream_buffers


# ---- 03.next_fetch: the prefetch distance rule ----------------------------------------------------
def _next_fetch(rank: int, streamed: int, distance: int) -> dict:
    return {"buffers": stream_buffers(streamed, distance), "fetch": _package_next_fetch(rank, streamed, distance)}


def _next_fetch_cases() -> list[Case]:
    return [Case("distance 0: synchronous, one buffer, nothing fetched ahead", dict(rank=2, streamed=6, distance=0)),
            Case("distance 1: two buffers, the copy two ranks on", dict(rank=0, streamed=6, distance=1)),
            Case("the middle of a step: rank + (d + 1)", dict(rank=1, streamed=8, distance=2)),
            Case("rank + buffers is the last rank", dict(rank=4, streamed=8, distance=2)),
            Case("rank + buffers is one past the last: the next step", dict(rank=5, streamed=8, distance=2)),
            Case("the last rank: its buffer's next user is in the next step", dict(rank=7, streamed=8, distance=2)),
            Case("a distance longer than the streamed layers: bounded by the buffers",
                 dict(rank=1, streamed=3, distance=5)),
            Case("one streamed layer: its one buffer takes it again for the next step",
                 dict(rank=0, streamed=1, distance=1))]


def _next_fetch_strategy():
    from hypothesis import strategies as st

    @st.composite
    def kw(draw):
        streamed = draw(st.integers(1, 12))
        return dict(rank=draw(st.integers(0, streamed - 1)), streamed=streamed, distance=draw(st.integers(0, 16)))
    return kw()


def _buffers_rule(kw: dict, got: int, expected: int) -> str:
    n, d = kw["streamed"], kw["distance"]
    if d == 0:
        return ("distance 0 is the synchronous baseline: one buffer, into which each streamed layer is fetched "
                "when it is needed")
    if d + 1 > n and got == d + 1:
        return (f"there are only min(d + 1, streamed) = {expected} buffers: with {n} streamed layers each has a "
                f"buffer of its own, so a distance of {d} cannot be reached (it is {n - 1} at most)")
    return (f"distance {d} keeps d + 1 = {d + 1} layer-sized buffers (one computing, d in flight or ready), never "
            f"more than the {n} streamed layers: min(d + 1, streamed) = {expected}")


def _fetch_rule(kw: dict, got, expected) -> str:
    rank, n, d = kw["rank"], kw["streamed"], kw["distance"]
    b = stream_buffers(n, d)
    if expected is None:
        return ("distance 0 is the synchronous baseline: each layer is fetched when it is needed, so nothing is "
                "fetched ahead: 'fetch' is None")
    if got is None:
        return f"at distance {d} >= 1 every computed layer frees its buffer, and the next copy starts into it at once"
    if isinstance(got, bool) or not isinstance(got, int):
        return f"'fetch' is a rank (an int) or None, got {type(got).__name__}"
    if got == rank + b and got >= n:
        return (f"rank + buffers = {got} is past the last streamed rank ({n - 1}): the buffer's next user is the "
                f"same buffer's first rank in the next step, rank % buffers = {rank} % {b} = {expected}")
    if got == rank + d and d + 1 <= n:
        return (f"distance {d} uses d + 1 = {b} buffers: the buffer rank {rank} frees is the one rank {rank} + {b} "
                f"lives in (rank + d = {got} lives in another, already in flight or ready)")
    if 0 <= got < n and got % b != rank % b:
        return (f"rank {got} lives in buffer {got} % {b} = {got % b}, not in buffer {rank % b}, the one rank {rank} "
                "just freed: the copy would overwrite weights still to compute")
    return (f"after rank {rank} computes, buffer {rank} % {b} = {rank % b} is free: fetch the next rank that lives "
            f"in it, rank + buffers ({rank + b}), or past the last rank, rank % buffers in the next step")


def _next_fetch_compare(kw: dict, got, expected) -> str | None:
    if not isinstance(got, dict) or set(got) != {"buffers", "fetch"}:
        return f"expected a dict with keys 'buffers' and 'fetch', got {type(got).__name__} {show(got)}"
    b = got["buffers"]
    if isinstance(b, bool) or not isinstance(b, int):
        return f"'buffers': expected the int {expected['buffers']}, got {type(b).__name__} {show(b)}"
    if b != expected["buffers"]:
        return (f"'buffers': expected {expected['buffers']}, got {b}\n"
                + _buffers_rule(kw, b, expected["buffers"]))
    f = got["fetch"]
    if f == expected["fetch"] and type(f) is type(expected["fetch"]):
        return None
    return f"'fetch': expected {show(expected['fetch'])}, got {show(f)}\n" + _fetch_rule(kw, f, expected["fetch"])


# ---- 03.ideal_times: the stall no schedule can hide ------------------------------------------------
def _ideal_times(t_resident: float, compute: dict, copy: dict, streamed: list) -> dict:
    return _package_ideal_times(t_resident, compute, copy, streamed)


def _ideal_cases() -> list[Case]:
    return [Case("copies shorter than the compute: everything hides",
                 dict(t_resident=0.010, compute={(1, 0): 0.001, (1, 1): 0.002, (1, 2): 0.002},
                      copy={1: 0.0015, 2: 0.001}, streamed=[1, 2])),
            Case("copies longer than the compute: each execution pays the difference",
                 dict(t_resident=0.010, compute={(1, 0): 0.001, (1, 1): 0.001, (1, 2): 0.001},
                      copy={1: 0.003, 2: 0.002}, streamed=[1, 2])),
            Case("a layer that computes in no time: its whole copy is stall",
                 dict(t_resident=0.005, compute={(1, 0): 0.001, (1, 1): 0.0}, copy={1: 0.002}, streamed=[1])),
            Case("a resident layer's executions are not copied",
                 dict(t_resident=0.020, compute={(1, 0): 0.004, (1, 1): 0.001, (2, 0): 0.004, (2, 1): 0.001},
                      copy={1: 0.003}, streamed=[1])),
            Case("one streamed layer over three steps: copied again every step",
                 dict(t_resident=0.012, compute={(1, 0): 0.001, (2, 0): 0.001, (3, 0): 0.001},
                      copy={0: 0.002}, streamed=[0])),
            Case("nothing streamed: both bounds are the all-resident time",
                 dict(t_resident=0.008, compute={(1, 0): 0.002, (1, 1): 0.002}, copy={}, streamed=[])),
            Case("the copies add up to more than the all-resident run: the one-lane bound",
                 dict(t_resident=0.004, compute={(1, 0): 0.001, (1, 1): 0.001, (2, 0): 0.001, (2, 1): 0.001},
                      copy={0: 0.003, 1: 0.003}, streamed=[0, 1]))]


def _ideal_strategy():
    from hypothesis import strategies as st

    ms = st.integers(0, 20).map(lambda k: k / 4000)          # 0 .. 5 ms in quarter-millisecond steps

    @st.composite
    def kw(draw):
        layers = draw(st.integers(1, 4))
        steps = draw(st.integers(1, 3))
        streamed = sorted(draw(st.sets(st.integers(0, layers - 1), max_size=layers)))
        compute = {(s, i): draw(ms) for s in range(1, steps + 1) for i in range(layers)}
        copy = {i: draw(ms) for i in streamed}
        t_resident = sum(compute.values()) + draw(ms)       # the layers' compute and what is not a layer
        return dict(t_resident=t_resident, compute=compute, copy=copy, streamed=streamed)
    return kw()


def _ideal_variants(kw: dict) -> dict[str, dict]:
    """Common slips, each as the answer it gives, with the rule it breaks."""
    t, comp, copy, streamed = kw["t_resident"], kw["compute"], kw["copy"], kw["streamed"]
    mine = [(k, c) for k, c in comp.items() if k[1] in streamed]
    first = {}
    for (_, layer), c in mine:
        first.setdefault(layer, c)
    return {
        "each streamed layer counted once, not once per step": {
            "t_ideal": t - sum(first.values()) + sum(max(copy[i], c) for i, c in first.items()),
            "t_lane": max(t, sum(copy.values())),
            "rule": "the streamed layers are fetched again at every step: each execution (step, layer) costs its "
                    "own max(copy, compute), and its copy counts in the lane's sum"},
        "the copies added to the all-resident time": {
            "t_ideal": t + sum(copy[k[1]] for k, _ in mine), "t_lane": None,
            "rule": "a copy overlaps the compute it hides behind: an execution costs max(copy, compute), not "
                    "copy + compute (t_ideal = t_resident - sum C_e + sum max(K, C_e))"},
        "the copies' excess never counted": {
            "t_ideal": t, "t_lane": None,
            "rule": "a copy longer than its layer's compute cannot hide: the excess K - C_e is stall, so "
                    "t_ideal = t_resident - sum C_e + sum max(K, C_e)"},
        "the lane's sum without the all-resident floor": {
            "t_ideal": None, "t_lane": sum(copy[k[1]] for k, _ in mine),
            "rule": "t_lane = max(t_resident, sum of the copies): the compute cannot beat all-resident, however "
                    "fast the link"},
    }


def _ideal_compare(kw: dict, got, expected) -> str | None:
    if not isinstance(got, dict):
        return f"expected a dict with keys 't_ideal' and 't_lane', got {type(got).__name__} {show(got)}"
    msg = compare_values(got, expected, rel=1e-9, abs_=1e-12)
    if msg is None:
        return None
    resident = sorted({k[1] for k in kw["compute"]} - set(kw["streamed"]))
    for key in ("t_ideal", "t_lane"):
        g = got.get(key)
        if not isinstance(g, (int, float)) or isinstance(g, bool) or math.isclose(g, expected[key], rel_tol=1e-9,
                                                                                   abs_tol=1e-12):
            continue
        for name, v in _ideal_variants(kw).items():
            if v[key] is not None and math.isclose(g, v[key], rel_tol=1e-9, abs_tol=1e-12):
                return f"{msg}\n{name}: {v['rule']}"
        if resident:
            wrong = dict(kw, streamed=sorted(kw["streamed"] + resident))
            wrong["copy"] = {**{i: 0.0 for i in resident}, **kw["copy"]}
            w = _package_ideal_times(**wrong)[key]
            if math.isclose(g, w, rel_tol=1e-9, abs_tol=1e-12) and not math.isclose(w, expected[key], rel_tol=1e-9):
                return (f"{msg}\nlayer(s) {resident} are resident (not in streamed): they are never copied, and "
                        "their compute stays as it is")
        rule = ("t_ideal = t_resident - sum C_e + sum max(K_l, C_e) over the streamed executions e = (step, layer): "
                "each costs the longer of its copy and its compute" if key == "t_ideal" else
                "t_lane = max(t_resident, sum of K_l over the streamed executions): one copy lane moves the bytes "
                "one layer at a time, and the compute cannot beat all-resident")
        return f"{msg}\n{rule}"
    return msg


EXERCISES = [
    Exercise(
        id="03.next_fetch", notebook="03_prefetch",
        title="The prefetch distance rule: the buffers, and which copy starts next",
        teaches="how a distance d becomes d + 1 fixed buffers, why the distance is bounded by the buffers, and how "
                "the schedule runs across the step boundary",
        statement=(
            "Weight streaming at distance `d >= 1` keeps `d + 1` layer-sized buffers, but never more than the "
            "`streamed` layers (at distance 0, the synchronous baseline, one), and the streamed layer of rank `r` "
            "always lives in buffer `r % buffers`. When rank `rank` has computed, its buffer is free and a copy "
            "starts into it. Return `{\"buffers\": ..., \"fetch\": ...}`: the number of buffers, and the rank "
            "whose copy starts now (past the last streamed rank, a rank of the *next* step: the same weights are "
            "needed again); `fetch` is `None` at distance 0, where nothing is fetched ahead."),
        hints=["First the number of buffers: `1` at distance 0, else `d + 1`, but never more than `streamed` "
               "(a distance of 5 over 3 streamed layers can only keep 3 buffers).",
               "The freed buffer is `rank % buffers`; the next rank living in it is `rank + buffers`. When that is "
               "`>= streamed`, this step is over for that buffer: its first user in the next step is the smallest "
               "rank with the same remainder.",
               "`buffers = 1 if distance == 0 else min(distance + 1, streamed)`; `nxt = rank + buffers`; "
               "`fetch = nxt if nxt < streamed else rank % buffers` (and `None` when `distance == 0`)."],
        stub=('def next_fetch(rank: int, streamed: int, distance: int) -> dict:\n'
              '    """{"buffers": ..., "fetch": ...}: the streaming buffers, and the rank whose copy starts into the\n'
              '    buffer rank `rank` frees when it has computed (a rank of the next step past the last; None at\n'
              '    distance 0)."""\n'
              '    # your code here\n'
              '    raise NotImplementedError'),
        reference=_next_fetch, cases=_next_fetch_cases, strategy=_next_fetch_strategy, compare=_next_fetch_compare,
        plugs_into="section 2's memory demo and section 3's live timeline: stream_weights(..., schedule=next_fetch) "
                   "starts every copy your schedule names (checked against the rule at install)"),
    Exercise(
        id="03.ideal_times", notebook="03_prefetch", title="The stall no schedule can hide",
        teaches="why a streamed layer costs max(copy, compute) at best, why weights are copied again every step, "
                "and what one copy lane bounds",
        statement=(
            "An all-resident run took `t_resident` seconds; `compute[(step, layer)]` is each layer execution's "
            "compute time (resident layers too), `copy[layer]` a streamed layer's copy time, `streamed` the "
            "streamed layers. With perfect prefetching each streamed execution costs the longer of its copy and "
            "its compute, nothing else changes: return `{\"t_ideal\": ..., \"t_lane\": ...}`, where `t_lane` is "
            "the one-copy-lane bound: the all-resident time, or all the copies back to back if that is longer."),
        hints=["Only the executions of streamed layers change, and a streamed layer is copied for *every* step it "
               "computes in: loop over `compute.items()` and keep those whose layer is in `streamed`.",
               "A copy overlaps the compute of the layers before it, so an execution costs `max(K, C)`, not "
               "`K + C`: replace its `C` by `max(K, C)` in the all-resident time.",
               "`t_ideal = t_resident - sum(C) + sum(max(copy[layer], C))` and "
               "`t_lane = max(t_resident, sum(copy[layer]))`, both over the streamed executions."],
        stub=('def ideal_times(t_resident: float, compute: dict, copy: dict, streamed: list) -> dict:\n'
              '    """{"t_ideal": ..., "t_lane": ...} in seconds: the all-resident run with every streamed execution\n'
              '    costing max(copy, compute), and the one-copy-lane bound."""\n'
              '    # your code here\n'
              '    raise NotImplementedError'),
        reference=_ideal_times, cases=_ideal_cases, strategy=_ideal_strategy, compare=_ideal_compare,
        plugs_into="section 2's hidden share: streaming_experiment(..., ideal=ideal_times) computes t_ideal and "
                   "t_lane of every all-resident run with yours (and section 6's verdict on the 80 % criterion)"),
]
