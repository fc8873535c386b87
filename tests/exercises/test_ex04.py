"""Notebook 04's exercises: the solutions and the references pass, planted mistakes are caught with
the case and the rule named, and the SLO guard's hook the breaker plugs into
(``SLOConfig(update=...)``) runs the learner's function and turns a wrong answer into one
WorkbenchError.  (The admission hook, ``SchedulerConfig(admission=...)``, is tested in
tests/sched/test_admission.py.)"""

from __future__ import annotations

import pytest

from workbench.errors import ConfigError, WorkbenchError
from workbench.exercises import check_fn, get, load_solution
from workbench.sched.admission import admit as package_admit
from workbench.serve.slo import SLOConfig, SLOGuard, ewma_step


@pytest.mark.parametrize("eid", ["04.admit", "04.breaker"])
def test_the_solution_and_the_reference_pass(eid):
    ex = get(eid)
    assert check_fn(ex, load_solution(eid)).passed
    assert check_fn(ex, ex.reference).passed


def test_the_references_are_the_packages_own():
    assert get("04.admit").reference is package_admit
    assert get("04.breaker").reference is ewma_step


# ---- 04.admit ------------------------------------------------------------------------------------
def _admit(key=lambda r: (-r["priority"], -r["cached"], r["arrival"]), overtake=False, chunk=lambda t, left: left,
           unchunked=lambda t, busy: 0 if busy else t, slots=True, blocks_fit=lambda need, free: need <= free,
           left0=lambda budget, scheduled: budget - scheduled, pair=lambda rid, n: (rid, n)):
    """A planted admission rule built from pieces (each default is right)."""
    def admit(waiting, budget, scheduled_tokens, free_seqs, free_blocks, chunked_prefill):
        left, busy, out = left0(budget, scheduled_tokens), scheduled_tokens > 0, []
        for r in sorted(waiting, key=key):
            if left <= 0:
                break
            if (slots and free_seqs <= 0) or not blocks_fit(r["blocks"], free_blocks):
                if overtake:
                    continue
                break
            n = r["tokens"] if r["tokens"] <= left else chunk(r["tokens"], left) if chunked_prefill \
                else unchunked(r["tokens"], busy)
            out.append(pair(r["id"], n))
            left, free_seqs, free_blocks, busy = left - n, free_seqs - 1, free_blocks - r["blocks"], busy or n > 0
        return out
    return admit


def test_admit_ignoring_priority_is_named():
    r = check_fn(get("04.admit"), _admit(key=lambda r: r["arrival"]))
    assert "a higher priority first" in r.case
    assert "r0 is admitted where r1 should be: r1 has priority 1, r0 0: the higher priority is admitted first" \
        in r.rule


def test_admit_ignoring_the_cached_prefix_is_named():
    r = check_fn(get("04.admit"), _admit(key=lambda r: (-r["priority"], r["arrival"])))
    assert "the longest cached prefix" in r.case
    assert "r2 has 8 prompt tokens in the prefix cache, r0 0: the longest cached prefix first" in r.rule


def test_admit_overtaking_is_named():
    r = check_fn(get("04.admit"), _admit(overtake=True))
    assert "no overtaking" in r.case
    assert "r0 needs 5 KV blocks, 3 are free: admission stops at the first request that does not fit" in r.rule
    assert "r1, behind it, may not overtake it" in r.rule


def test_admit_chunk_off_by_one_is_named():
    r = check_fn(get("04.admit"), _admit(chunk=lambda t, left: left - 1))
    assert "chunked prefill: the last prompt admitted" in r.case
    assert "r1 computes 25 tokens, expected 26: it has 100 to compute and 26 are left" in r.rule


def test_admit_forgetting_the_running_sequences_is_over_the_budget():
    r = check_fn(get("04.admit"), _admit(left0=lambda budget, scheduled: budget))
    assert "chunked prefill" in r.case
    assert "the step computes 72 tokens (8 already scheduled + 64 admitted), over the budget of 64" in r.rule


def test_admit_a_whole_prompt_over_the_budget_without_chunking_is_named():
    r = check_fn(get("04.admit"), _admit(unchunked=lambda t, busy: t))
    assert "chunked prefill off: a prompt larger than what is left waits" in r.case
    assert "over the budget of 64" in r.rule and "admitted with 0 tokens" in r.rule


def test_admit_never_running_a_long_prompt_alone_is_named():
    r = check_fn(get("04.admit"), _admit(unchunked=lambda t, busy: 0))
    assert "a long prompt takes a step of its own" in r.case
    assert "nothing else computes in this step, so its whole prompt runs now" in r.rule


def test_admit_the_block_boundary_is_named():
    r = check_fn(get("04.admit"), _admit(blocks_fit=lambda need, free: need < free))
    assert "the last free blocks" in r.case
    assert "r0 must be admitted" in r.rule and "4 KV blocks free, and it needs 4 blocks" in r.rule


def test_admit_no_slot_check_is_named():
    r = check_fn(get("04.admit"), _admit(slots=False))
    assert "until the sequence slots run out" in r.case
    assert "3 requests are admitted, but 2 sequence slots are free" in r.rule


def test_admit_float_tokens_is_a_type_error():
    r = check_fn(get("04.admit"), _admit(pair=lambda rid, n: (rid, float(n))))
    assert "r0 computes 10.0 tokens: the number of tokens is an int" in r.rule


def test_admit_a_mistake_only_random_inputs_find_is_shrunk():
    """Forgetting that an admitted prompt makes the step busy: without chunked prefill a second prompt
    that does not fit must then wait; hypothesis finds it and shrinks it."""
    def admit(waiting, budget, scheduled_tokens, free_seqs, free_blocks, chunked_prefill):
        return _admit(unchunked=lambda t, busy: 0 if scheduled_tokens > 0 else t)(
            waiting, budget, scheduled_tokens, free_seqs, free_blocks, chunked_prefill)
    r = check_fn(get("04.admit"), admit)
    assert not r.passed and "property-based" in r.case
    assert "chunked_prefill=False" in r.call and "scheduled_tokens=0" in r.call
    assert "over the budget" in r.rule


# ---- 04.breaker ----------------------------------------------------------------------------------
def _breaker(seed=lambda p: p, trip=lambda p, bound: p > bound, healthy=lambda p, lim: p <= lim,
             ewma=lambda a, p, b: a * p + (1 - a) * b, min_samples_on=True, threshold_on=True, keep_on_trip=True):
    def ewma_breaker(baseline, p95, samples, alpha, factor, learn_factor, min_samples, min_threshold):
        if min_samples_on and samples < min_samples:
            return baseline, False
        if baseline is None:
            return seed(p95), False
        bound = max(factor * baseline, min_threshold) if threshold_on else factor * baseline
        if trip(p95, bound):
            return (baseline if keep_on_trip else ewma(alpha, p95, baseline)), True
        if healthy(p95, learn_factor * baseline):
            return ewma(alpha, p95, baseline), False
        return baseline, False
    return ewma_breaker


def test_breaker_at_the_bound_is_named():
    r = check_fn(get("04.breaker"), _breaker(trip=lambda p, bound: p >= bound))
    assert "exactly at the bound" in r.case
    assert "trips: expected False, got True" in r.rule and "exactly at the bound does not trip" in r.rule


def test_breaker_swapped_alpha_is_named():
    r = check_fn(get("04.breaker"), _breaker(ewma=lambda a, p, b: (1 - a) * p + a * b))
    assert "a healthy P95 is learned by EWMA" in r.case
    assert "baseline: expected 0.2515625, got 0.2796875" in r.rule
    assert "alpha * p95 + (1 - alpha) * baseline" in r.rule


def test_breaker_first_sample_is_named():
    r = check_fn(get("04.breaker"), _breaker(seed=lambda p: 0.0))
    assert "the first full window seeds the baseline" in r.case
    assert "baseline: expected 0.2, got 0.0" in r.rule and "seeds the baseline (baseline = p95)" in r.rule


def test_breaker_too_few_samples_is_named():
    r = check_fn(get("04.breaker"), _breaker(min_samples_on=False))
    assert "not enough samples" in r.case
    assert "only 3 of the 8 samples it needs are in the window" in r.rule


def test_breaker_recovering_at_learn_factor_is_named():
    r = check_fn(get("04.breaker"), _breaker(healthy=lambda p, lim: p < lim))
    assert "recovering" in r.case
    assert "P95 0.3125 <= learn_factor x baseline = 0.3125: healthy" in r.rule


def test_breaker_min_threshold_is_named():
    r = check_fn(get("04.breaker"), _breaker(threshold_on=False))
    assert "below min_threshold" in r.case
    assert "below min_threshold it never trips" in r.rule


def test_breaker_learning_a_trip_is_named():
    r = check_fn(get("04.breaker"), _breaker(keep_on_trip=False))
    assert "just over the bound trips" in r.case
    assert "the baseline stays (a slow P95 is not learned)" in r.rule


def test_breaker_a_wrong_shape_is_one_line():
    r = check_fn(get("04.breaker"), lambda **kw: ewma_step(**kw)[0])
    assert "expected a pair (baseline, trips)" in r.rule


# ---- the SLO guard's hook: SLOConfig(update=...) -------------------------------------------------
def _feed(update, ttfts, **cfg):
    g = SLOGuard(SLOConfig(factor=2.0, window=10, min_samples=4, cooldown_s=1.0, **cfg, update=update),
                 clock=lambda: 0.0)
    for i, t in enumerate(ttfts):
        g.record(t, now=0.1 * i)
    return g


TTFTS = [0.1, 0.11, 0.09, 0.1, 0.12, 0.1, 0.3, 0.35, 0.4, 0.5, 0.6]


def test_the_learners_breaker_drives_the_guard_as_the_packages_does():
    own, mine = _feed(None, TTFTS), _feed(load_solution("04.breaker"), TTFTS)
    assert own.transitions and mine.transitions == own.transitions
    assert mine.baseline == pytest.approx(own.baseline)
    assert mine.describe()["update"] == "ewma_breaker" and own.describe()["update"] is None


def test_a_breaker_that_never_trips_keeps_the_guard_closed():
    g = _feed(lambda **kw: (ewma_step(**kw)[0], False), TTFTS)
    assert g.state_at(2.0) == "closed" and not g.transitions


@pytest.mark.parametrize("update, words", [
    (lambda **kw: 0.1, "SLOConfig.update must return (baseline, trips), got 0.1"),
    (lambda **kw: (None, False), "SLOConfig.update returned baseline None"),
    (lambda **kw: (0.1, "yes"), "SLOConfig.update returned trips='yes'"),
    (lambda **kw: (kw["p95"], True), "tripped on the first full window"),
    (lambda **kw: {}["x"], "SLOConfig.update raised KeyError"),
])
def test_a_bad_breaker_answer_is_one_line_and_changes_nothing(update, words):
    g = SLOGuard(SLOConfig(factor=2.0, window=10, min_samples=2, update=update), clock=lambda: 0.0)
    g.record(0.1, now=0.0)
    with pytest.raises(WorkbenchError) as e:
        g.record(0.1, now=0.1)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert g.baseline is None and g.state_at(0.2) == "closed" and not g.transitions


def test_the_config_refuses_an_update_that_is_not_a_function():
    with pytest.raises(ConfigError, match="SLOConfig.update"):
        SLOConfig(update=3)
