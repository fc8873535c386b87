"""Notebook 04's exercises: the scheduler's admission rule, and the SLO guard's EWMA breaker."""

from __future__ import annotations

from workbench.exercises.core import Case, Exercise, compare_values, show
from workbench.sched.admission import admission_problem, admit, order_key
from workbench.serve.slo import ewma_step


# ---- 04.admit ------------------------------------------------------------------------------------
def _req(i: int, tokens: int, blocks: int, priority: int = 0, cached: int = 0) -> dict:
    return {"id": f"r{i}", "priority": priority, "cached": cached, "arrival": i, "tokens": tokens, "blocks": blocks}


def _admit_cases() -> list[Case]:
    step = dict(budget=64, scheduled_tokens=8, free_seqs=4, free_blocks=16, chunked_prefill=True)
    return [
        Case("nothing waits", dict(waiting=[], **step)),
        Case("equal priority: first come, first served, until the sequence slots run out",
             dict(waiting=[_req(2, 6, 1), _req(0, 10, 1), _req(1, 8, 1)], **{**step, "free_seqs": 2})),
        Case("a higher priority first, then the longest cached prefix",
             dict(waiting=[_req(0, 12, 2), _req(1, 12, 2, priority=1), _req(2, 4, 1, cached=8)], **step)),
        Case("a prompt that takes exactly the rest of the budget and the last free blocks",
             dict(waiting=[_req(0, 56, 4), _req(1, 4, 1)], **{**step, "free_blocks": 4})),
        Case("chunked prefill: the last prompt admitted computes what is left of the budget",
             dict(waiting=[_req(0, 30, 2), _req(1, 100, 7)], **step)),
        Case("no overtaking: the first request that does not fit stops admission",
             dict(waiting=[_req(0, 40, 5), _req(1, 8, 1)], **{**step, "free_blocks": 3})),
        Case("chunked prefill off: a prompt larger than what is left waits (admitted, 0 tokens)",
             dict(waiting=[_req(0, 100, 7), _req(1, 20, 2)], **{**step, "chunked_prefill": False})),
        Case("chunked prefill off, nothing else in the step: a long prompt takes a step of its own",
             dict(waiting=[_req(0, 200, 13), _req(1, 20, 2)],
                  **{**step, "scheduled_tokens": 0, "chunked_prefill": False})),
    ]


def _admit_strategy():
    from hypothesis import strategies as st

    @st.composite
    def kw(draw):
        n = draw(st.integers(0, 6))
        listed = draw(st.permutations(list(range(n))))
        reqs = {i: {"id": f"r{i}", "priority": draw(st.integers(0, 2)), "cached": draw(st.sampled_from([0, 0, 8, 16])),
                    "arrival": i, "tokens": draw(st.one_of(st.integers(1, 24), st.integers(1, 100))),
                    "blocks": draw(st.integers(1, 5))}
                for i in range(n)}
        budget = draw(st.sampled_from([16, 32, 64]))
        scheduled = draw(st.one_of(st.sampled_from([0, budget // 2, budget]), st.integers(0, budget)))
        return dict(waiting=[reqs[i] for i in listed], budget=budget, scheduled_tokens=scheduled,
                    free_seqs=draw(st.integers(0, 5)), free_blocks=draw(st.integers(0, 20)),
                    chunked_prefill=draw(st.booleans()))
    return kw()


def _order_rule(first: dict, second: dict) -> str:
    """Why ``first`` is admitted before ``second`` (the order's deciding key)."""
    a, b = first, second
    if a["priority"] != b["priority"]:
        return (f"{a['id']} has priority {a['priority']}, {b['id']} {b['priority']}: the higher priority is "
                "admitted first")
    if a["cached"] != b["cached"]:
        return (f"at equal priority, {a['id']} has {a['cached']} prompt tokens in the prefix cache, {b['id']} "
                f"{b['cached']}: the longest cached prefix first (prefix-aware: less to compute)")
    return (f"{a['id']} arrived before {b['id']} (arrival {a['arrival']} < {b['arrival']}): at equal priority and "
            "cached prefix, first come, first served")


def _admit_compare(kw: dict, got, expected) -> str | None:
    problem = admission_problem(got, **kw)
    if problem is not None and problem.startswith("the step computes"):
        return problem + ("\nwith chunked prefill, a prompt larger than what is left of the budget computes only "
                          "what is left" if kw["chunked_prefill"] else
                          "\nwithout chunked prefill, a prompt larger than what is left is admitted with 0 tokens "
                          "(it waits for a step of its own), unless nothing else computes in this step")
    if problem is not None:
        return problem
    got = [(rid, n) for rid, n in got]
    if got == expected:
        return None
    by_id = {r["id"]: r for r in kw["waiting"]}
    order = sorted(kw["waiting"], key=order_key)
    budget, chunked = kw["budget"], kw["chunked_prefill"]
    for i in range(max(len(got), len(expected))):
        g = got[i] if i < len(got) else None
        e = expected[i] if i < len(expected) else None
        if g == e:
            continue
        done = expected[:i]
        left = budget - kw["scheduled_tokens"] - sum(n for _, n in done)
        slots = kw["free_seqs"] - i
        blocks = kw["free_blocks"] - sum(by_id[rid]["blocks"] for rid, _ in done)
        state = (f"{left} tokens of the budget left, {slots} sequence slot{'' if slots == 1 else 's'} and {blocks} KV "
                 f"block{'' if blocks == 1 else 's'} free")
        if e is None:                              # admitted past the point where the rule stops
            stop = order[len(expected)] if len(expected) < len(order) else None
            if left <= 0:
                why = (f"the budget is spent ({budget - left} tokens computed in this step, budget {budget}): "
                       "admission stops when no token is left")
            elif slots <= 0:
                why = "no sequence slot is left (max_num_seqs): admission stops"
            else:
                why = (f"{stop['id']} needs {stop['blocks']} KV blocks, {blocks} are free: admission stops at the "
                       "first request that does not fit")
            if stop is not None and g[0] != stop["id"]:
                why += (f"; {g[0]}, behind it, may not overtake it (first come, first served: a large request "
                        "would starve behind smaller ones)")
            return f"{g[0]} is admitted, but {why}"
        if g is None:                              # stopped early
            r = by_id[e[0]]
            how = "" if e[1] == r["tokens"] else (
                f" Its {r['tokens']} tokens are more than the {left} left, so it computes {e[1]} this step"
                + (" (chunked prefill off: it waits for a step of its own, holding its slot and blocks)" if e[1] == 0
                   else " (chunked prefill: the rest in later steps)") + ".")
            return (f"{e[0]} must be admitted: {state}, and it needs {r['blocks']} blocks.{how} Admission goes on "
                    "until the budget, the slots or the blocks run out")
        if g[0] != e[0]:
            return f"{g[0]} is admitted where {e[0]} should be: {_order_rule(by_id[e[0]], by_id[g[0]])}"
        r = by_id[e[0]]
        head = f"{e[0]} computes {g[1]} tokens, expected {e[1]}: it has {r['tokens']} to compute and {left} are left"
        if chunked:
            return f"{head}: with chunked prefill it computes min(the two) (a prompt larger than what is left is split)"
        if e[1] == 0:
            return (f"{head}: chunked prefill is off and its prompt does not fit in what is left, so it is admitted "
                    "(its blocks held) but computes nothing this step; its whole prompt gets a step of its own later")
        if e[1] > left:
            return (f"{head}: chunked prefill is off and nothing else computes in this step, so its whole prompt runs "
                    "now, over the budget: a step of its own")
        return f"{head}: its prompt fits in what is left of the budget: all of it is computed"
    return None


# ---- 04.breaker ------------------------------------------------------------------------------------
def _breaker_cases() -> list[Case]:
    cfg = dict(alpha=0.05, factor=2.0, learn_factor=1.25, min_samples=8, min_threshold=0.0)
    return [
        Case("not enough samples in the window yet (after a trip it starts again)",
             dict(baseline=0.25, p95=3.0, samples=3, **cfg)),
        Case("the first full window seeds the baseline (no previous average)",
             dict(baseline=None, p95=0.2, samples=8, **cfg)),
        Case("a healthy P95 is learned by EWMA", dict(baseline=0.25, p95=0.28125, samples=20, **cfg)),
        Case("alpha 1: the baseline becomes the P95",
             dict(baseline=0.25, p95=0.3, samples=20, **{**cfg, "alpha": 1.0})),
        Case("exactly at the bound (factor x baseline) does not trip",
             dict(baseline=0.25, p95=0.5, samples=20, **cfg)),
        Case("just over the bound trips, and the baseline stays",
             dict(baseline=0.25, p95=0.5000001, samples=20, **cfg)),
        Case("below min_threshold it never trips", dict(baseline=0.001, p95=0.004, samples=20,
                                                        **{**cfg, "min_threshold": 0.005})),
        Case("recovering: a P95 back at exactly learn_factor x baseline is learned again",
             dict(baseline=0.25, p95=0.3125, samples=20, **{**cfg, "alpha": 0.5})),
    ]


def _breaker_strategy():
    from hypothesis import strategies as st

    @st.composite
    def kw(draw):
        # dyadic baselines and ratios: factor x baseline is exact however it is computed
        baseline = draw(st.one_of(st.none(), st.integers(1, 64).map(lambda k: k / 64)))
        factor = draw(st.sampled_from([2.0, 4.0]))
        learn = draw(st.sampled_from([1.0, 1.25, 1.5]))
        if baseline is not None and draw(st.booleans()):
            p95 = baseline * draw(st.sampled_from([0.5, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0, 5.0]))
        else:
            p95 = draw(st.integers(0, 256).map(lambda k: k / 64))
        min_samples = draw(st.integers(1, 20))
        return dict(baseline=baseline, p95=p95, samples=draw(st.integers(1, 30)),
                    alpha=draw(st.sampled_from([0.05, 0.1, 0.5, 1.0])), factor=factor, learn_factor=learn,
                    min_samples=min_samples, min_threshold=draw(st.sampled_from([0.0, 0.0, 0.5, 1.0])))
    return kw()


def _breaker_compare(kw: dict, got, expected) -> str | None:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        return f"expected a pair (baseline, trips), got {type(got).__name__} {show(got)}"
    gb, gt = got
    eb, et = expected
    b, p, a = kw["baseline"], kw["p95"], kw["alpha"]
    if not isinstance(gt, bool) and type(gt).__name__ != "bool_":
        return f"trips: expected True or False, got {type(gt).__name__} {show(gt)}"
    if kw["samples"] < kw["min_samples"]:
        why = (f"only {kw['samples']} of the {kw['min_samples']} samples it needs are in the window: nothing happens "
               "yet (no trip, the baseline as it was)")
    elif b is None:
        why = "the first full window's P95 seeds the baseline (baseline = p95); with nothing to compare with, no trip"
    else:
        bound = max(kw["factor"] * b, kw["min_threshold"])
        where = (f"max(factor x baseline = {show(kw['factor'] * b)}, min_threshold = {show(kw['min_threshold'])}) "
                 f"= {show(bound)}")
        if et:
            why = f"P95 {show(p)} > {where}: the guard trips, and the baseline stays (a slow P95 is not learned)"
        elif p > kw["factor"] * b:
            why = f"P95 {show(p)} is over factor x baseline but not over {where}: below min_threshold it never trips"
        elif p <= kw["learn_factor"] * b:
            why = (f"P95 {show(p)} <= learn_factor x baseline = {show(kw['learn_factor'] * b)}: healthy, so the "
                   f"baseline learns it: alpha * p95 + (1 - alpha) * baseline = {show(a * p + (1 - a) * b)}"
                   + ("" if p < bound else
                      f" (and P95 exactly at the bound {show(bound)} does not trip: only above it)"))
        else:
            why = (f"P95 {show(p)} is above learn_factor x baseline = {show(kw['learn_factor'] * b)} but not above "
                   f"{where}: slow but no trip, and not learned (a slow period must not become the norm)"
                   + (" - exactly at the bound does not trip: only above it" if p == bound else ""))
    if bool(gt) != et:
        return f"trips: expected {et}, got {bool(gt)}\n{why}"
    msg = compare_values(gb, eb, rel=1e-9, abs_=1e-12, path="baseline")
    return None if msg is None else f"{msg}\n{why}"


EXERCISES = [
    Exercise(
        id="04.admit", notebook="04_scheduler", title="Admission under a token budget",
        teaches="how continuous batching fills a step: order, budget, slots, KV blocks, chunks, and no overtaking",
        statement=(
            "Each step, the scheduler decides which waiting requests join the batch. A request is a dict: `id`, "
            "`priority`, `cached` (prompt tokens already in the prefix cache), `arrival` (0, 1, 2, ...), `tokens` "
            "(prompt tokens it computes once admitted) and `blocks` (KV blocks it takes). Return "
            "`[(id, tokens computed this step), ...]` in admission order.\n\n"
            "- **Order:** priority (highest first), then `cached` (most first), then arrival.\n"
            "- **Who is admitted:** walk that order while the step has budget left (`budget - scheduled_tokens`: "
            "the running sequences came first). A request can be admitted when a sequence slot is free "
            "(`free_seqs`) and its `blocks` are free (`free_blocks`). The first request that cannot be admitted "
            "stops the walk: none behind it overtakes it.\n"
            "- **Tokens this step** (the budget decides how many, not whether it is admitted): all of `tokens` "
            "when they fit in what is left; otherwise, with `chunked_prefill`, what is left; without it, 0 (the "
            "request holds its slot and blocks and waits for a step of its own), except when nothing else "
            "computes in this step: then all of them, over the budget."),
        hints=["Sort once with a key (`-priority`, `-cached`, `arrival`), then walk that order keeping three counts: "
               "tokens left, free slots, free blocks. Stop (`break`, not `continue`) at the first request that "
               "cannot be admitted (no budget left, no slot, or not enough free blocks): a smaller one behind it may "
               "not overtake it, or a large request could wait forever. A prompt larger than the budget left is "
               "still admitted: it computes fewer tokens (or 0) this step.",
               "The budget check comes before the others: stop once `left <= 0`. A request's tokens this step: "
               "`tokens` when `tokens <= left`; else `left` with chunked prefill; else `0` if anything computes in "
               "this step already (`scheduled_tokens > 0` or an earlier admission with tokens > 0), otherwise "
               "`tokens`.",
               "`for r in sorted(waiting, key=...): if left <= 0 or free_seqs <= 0 or r['blocks'] > free_blocks: "
               "break`; then `n = ...`; `out.append((r['id'], n))`; `left -= n; free_seqs -= 1; "
               "free_blocks -= r['blocks']`."],
        stub=('def admit(waiting: list[dict], budget: int, scheduled_tokens: int, free_seqs: int, free_blocks: int,\n'
              '          chunked_prefill: bool) -> list[tuple[str, int]]:\n'
              '    """[(request id, prompt tokens it computes this step), ...], in the order they are admitted."""\n'
              '    # your code here\n'
              '    raise NotImplementedError'),
        reference=admit, cases=_admit_cases, strategy=_admit_strategy, compare=_admit_compare,
        plugs_into="the scheduler of a live engine (SchedulerConfig(admission=admit)): section 1's trace replayed "
                   "under your rule, its P95 TTFT and step-by-step replay beside the package's"),
    Exercise(
        id="04.breaker", notebook="04_scheduler", title="The SLO guard's EWMA breaker",
        teaches="how a latency circuit breaker learns what normal is (an EWMA) and when it trips",
        statement=(
            "The SLO guard of section 6 keeps a baseline P95 TTFT, learned while healthy. After each TTFT it "
            "looks at the window's P95 (`p95`, seconds; `samples` TTFTs in the window) and you return "
            "`(baseline, trips)`: nothing happens until `min_samples` samples are in; the first full window's "
            "P95 seeds the baseline (`baseline` is `None` until then); the guard trips when the P95 is above "
            "`max(factor * baseline, min_threshold)`, and the baseline stays. Otherwise a healthy P95 (at most "
            "`learn_factor * baseline`) is learned, `alpha * p95 + (1 - alpha) * baseline`, and a P95 between "
            "the two bounds changes nothing."),
        hints=["Check in this order: too few samples, no baseline yet, over the trip bound, healthy. Each returns "
               "at once.",
               "Above means strictly above: a P95 exactly at `factor * baseline` does not trip, and one exactly at "
               "`learn_factor * baseline` is still healthy. `min_threshold` raises the trip bound, never lowers it.",
               "`bound = max(factor * baseline, min_threshold)`; `if p95 > bound: return baseline, True`; "
               "`if p95 <= learn_factor * baseline: return alpha * p95 + (1 - alpha) * baseline, False`; "
               "`return baseline, False`."],
        stub=('def ewma_breaker(baseline: float | None, p95: float, samples: int, alpha: float, factor: float,\n'
              '                 learn_factor: float, min_samples: int, min_threshold: float) -> tuple:\n'
              '    """(the baseline after this sample, whether the guard trips)."""\n'
              '    # your code here\n'
              '    raise NotImplementedError'),
        reference=ewma_step, cases=_breaker_cases, strategy=_breaker_strategy, compare=_breaker_compare,
        plugs_into="the SLO guard of section 6's guarded ramp (SLOConfig(update=ewma_breaker)): it decides when "
                   "the live guard opens"),
]
