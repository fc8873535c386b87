"""Notebook 03's exercises: the solutions and the references pass, planted mistakes are caught with the
case and the rule named, and the two hooks the exercises plug into (stream_weights(schedule=...),
streaming_experiment(ideal=...)) run the learner's function and turn a wrong answer into one
WorkbenchError."""

from __future__ import annotations

import pytest

from workbench.bench import prefetch as P
from workbench.bench.prefetch import Workload
from workbench.bench.prefetch_streaming import _checked_ideal, ideal_times
from workbench.engine.sampling import SamplingParams
from workbench.errors import WorkbenchError
from workbench.exercises import check_fn, get, load_solution
from workbench.prefetch.weights import WeightStreamConfig, next_fetch, stream_buffers, stream_weights, weight_streamer


@pytest.mark.parametrize("eid", ["03.next_fetch", "03.ideal_times"])
def test_the_solution_and_the_reference_pass(eid):
    ex = get(eid)
    assert check_fn(ex, load_solution(eid)).passed
    assert check_fn(ex, ex.reference).passed


# ---- 03.next_fetch --------------------------------------------------------------------------------
def _schedule(buffers, fetch):
    """A planted schedule from two pieces: the buffer count and the rank fetched."""
    def next_fetch(rank, streamed, distance):
        b = buffers(streamed, distance)
        return {"buffers": b, "fetch": None if distance == 0 else fetch(rank, streamed, b, distance)}
    return next_fetch


RIGHT_BUFFERS = lambda n, d: 1 if d == 0 else min(d + 1, n)          # noqa: E731
RIGHT_FETCH = lambda r, n, b, d: r + b if r + b < n else r % b        # noqa: E731


def test_next_fetch_an_unbounded_buffer_count_is_named():
    r = check_fn(get("03.next_fetch"), _schedule(lambda n, d: 1 if d == 0 else d + 1, RIGHT_FETCH))
    assert "bounded by the buffers" in r.case
    assert "only min(d + 1, streamed) = 3 buffers" in r.rule and "cannot be reached" in r.rule


def test_next_fetch_off_by_one_rank_plus_d_is_named():
    r = check_fn(get("03.next_fetch"), _schedule(RIGHT_BUFFERS, lambda r, n, b, d: r + d if r + d < n else r % b))
    assert "distance 1" in r.case
    assert "d + 1 = 2 buffers" in r.rule and "rank + d = 1 lives in another" in r.rule


def test_next_fetch_the_step_boundary_is_named():
    r = check_fn(get("03.next_fetch"), _schedule(RIGHT_BUFFERS, lambda r, n, b, d: r + b))
    assert "one past the last: the next step" in r.case
    assert "past the last streamed rank (7)" in r.rule and "rank % buffers = 5 % 3 = 2" in r.rule


def test_next_fetch_wrapping_to_rank_0_names_the_buffer_in_use():
    r = check_fn(get("03.next_fetch"), _schedule(RIGHT_BUFFERS, lambda r, n, b, d: r + b if r + b < n else 0))
    assert "the next step" in r.case
    assert "rank 0 lives in buffer 0 % 3 = 0, not in buffer 2" in r.rule and "overwrite" in r.rule


def test_next_fetch_distance_0_fetches_nothing_ahead():
    def next_fetch(rank, streamed, distance):
        b = 1 if distance == 0 else min(distance + 1, streamed)
        return {"buffers": b, "fetch": rank + b if rank + b < streamed else rank % b}
    r = check_fn(get("03.next_fetch"), next_fetch)
    assert "distance 0" in r.case and "synchronous baseline" in r.rule and "None" in r.rule


def test_next_fetch_a_tuple_is_not_the_dict():
    r = check_fn(get("03.next_fetch"), lambda rank, streamed, distance: (1, None))
    assert "edge case" in r.case and "expected a dict with keys 'buffers' and 'fetch', got tuple" in r.rule


# ---- 03.ideal_times -------------------------------------------------------------------------------
def _execs(compute, streamed):
    return [(k, c) for k, c in compute.items() if k[1] in streamed]


def test_ideal_times_counting_each_layer_once_is_named():
    def ideal_times(t_resident, compute, copy, streamed):
        first = {}
        for (_, layer), c in _execs(compute, streamed):
            first.setdefault(layer, c)
        return {"t_ideal": t_resident + sum(max(copy[i], c) - c for i, c in first.items()),
                "t_lane": max(t_resident, sum(copy[i] for i in first))}
    r = check_fn(get("03.ideal_times"), ideal_times)
    assert "edge case" in r.case and "'t_ideal'" in r.rule
    assert "counted once, not once per step" in r.rule and "fetched again at every step" in r.rule


def test_ideal_times_copy_plus_compute_is_named():
    def ideal_times(t_resident, compute, copy, streamed):
        ex = _execs(compute, streamed)
        return {"t_ideal": t_resident + sum(copy[k[1]] for k, _ in ex),
                "t_lane": max(t_resident, sum(copy[k[1]] for k, _ in ex))}
    r = check_fn(get("03.ideal_times"), ideal_times)
    assert "everything hides" in r.case and "max(copy, compute), not copy + compute" in r.rule


def test_ideal_times_the_lane_without_its_floor_is_named():
    def ideal_times(t_resident, compute, copy, streamed):
        ex = _execs(compute, streamed)
        return {"t_ideal": t_resident - sum(c for _, c in ex) + sum(max(copy[k[1]], c) for k, c in ex),
                "t_lane": sum(copy[k[1]] for k, _ in ex)}
    r = check_fn(get("03.ideal_times"), ideal_times)
    assert "everything hides" in r.case and "'t_lane'" in r.rule and "max(t_resident, sum of the copies)" in r.rule


def test_ideal_times_a_list_is_not_the_dict():
    r = check_fn(get("03.ideal_times"), lambda t_resident, compute, copy, streamed: [t_resident, t_resident])
    assert "edge case" in r.case and "expected a dict with keys 't_ideal' and 't_lane', got list" in r.rule


# ---- the hooks ------------------------------------------------------------------------------------
PROMPTS = ["The list type is", "def f(x):"]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def test_stream_weights_runs_the_learners_schedule(bundled_llm):
    ref = [o.token_ids for o in bundled_llm.generate(PROMPTS, GREEDY)]
    calls = []
    sol = load_solution("03.next_fetch")

    def spy(**kw):
        calls.append(kw)
        return sol(**kw)
    st = stream_weights(bundled_llm.model, WeightStreamConfig(resident_layers=2, distance=2, transport="host"),
                        schedule=spy)
    try:
        assert [o.token_ids for o in bundled_llm.generate(PROMPTS, GREEDY)] == ref
        assert [c["rank"] for c in calls] == [0, 1, 2, 3] and st._next == [3, 1, 2, 0]
        assert st.stats()["demand"] == 0
    finally:
        st.remove()


@pytest.mark.parametrize("schedule,words", [
    (lambda rank, streamed, distance: {"buffers": 3, "fetch": rank + 2 if rank + 2 < streamed else rank % 3},
     "the next rank that lives in it is 3"),
    (lambda rank, streamed, distance: {"buffers": distance + 1, "fetch": 0}, "min(d + 1, streamed) = 4"),
    (lambda rank, streamed, distance: {"buffers": 3, "fetch": None}, "a rank (int)"),
    (lambda rank, streamed, distance: [3, 0], "a dict with 'buffers' and 'fetch'"),
    (lambda rank, streamed, distance: 1 / 0, "the schedule raised ZeroDivisionError"),
])
def test_a_wrong_schedule_is_one_error_and_nothing_is_installed(bundled_llm, schedule, words):
    cfg = WeightStreamConfig(resident_layers=2, distance=5 if "min(d" in words else 2, transport="host")
    with pytest.raises(WorkbenchError) as e:
        stream_weights(bundled_llm.model, cfg, schedule=schedule)
    assert words in str(e.value) and "\n" not in str(e.value)
    assert weight_streamer(bundled_llm.model) is None
    stream_weights(bundled_llm.model, cfg).remove()        # the model still streams and comes back


def test_the_package_rule_is_the_streamers():
    assert [stream_buffers(4, d) for d in (0, 1, 3, 9)] == [1, 2, 4, 4]
    assert [next_fetch(r, 4, 2) for r in range(4)] == [3, 1, 2, 0] and next_fetch(2, 4, 0) is None


def test_checked_ideal_states_each_rule_in_one_line():
    kw = dict(t_resident=1.0, compute={(1, 0): 0.5}, copy={0: 0.7}, streamed=[0])
    assert _checked_ideal(ideal_times, kw) == (pytest.approx(1.2), 1.0)
    for bad, words in ((lambda **k: [1.2, 1.0], "a dict with 't_ideal' and 't_lane'"),
                       (lambda **k: {"t_ideal": 0.9, "t_lane": 1.0}, "below the all-resident time"),
                       (lambda **k: {"t_ideal": 1.2, "t_lane": 0.5}, "max(t_resident, sum of the copies)"),
                       (lambda **k: {"t_ideal": float("nan"), "t_lane": 1.0}, "a finite number"),
                       (lambda **k: {}["t_ideal"], "ideal raised KeyError")):
        with pytest.raises(WorkbenchError) as e:
            _checked_ideal(bad, kw)
        assert words in str(e.value) and "\n" not in str(e.value)


def test_streaming_experiment_computes_the_bounds_with_the_learners_function(bundled_llm):
    w = Workload(1, 8, 3)
    eng = P.make_engine(None, None, w, threads=1)
    sol, seen = load_solution("03.ideal_times"), []

    def spy(**kw):
        seen.append(kw)
        return sol(**kw)
    exp = P.streaming_experiment(engine=eng, resident_layers=2, distances=(0, 2), workload=w, repeats=1,
                                 transport="host", ideal=spy)
    assert len(seen) == 1 and seen[0]["streamed"] == [2, 3, 4, 5]
    assert exp["t_ideal_runs"] == [pytest.approx(ideal_times(**seen[0])["t_ideal"])]
    assert exp["t_lane"] == pytest.approx(ideal_times(**seen[0])["t_lane"])
    with pytest.raises(WorkbenchError, match="below the all-resident time"):
        P.streaming_experiment(engine=eng, resident_layers=2, distances=(0,), workload=w, repeats=1,
                               transport="host", ideal=lambda **kw: {"t_ideal": 0.0, "t_lane": 0.0})
