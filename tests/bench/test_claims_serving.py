"""The serving-side claims (workbench.bench.claims.serving_*): all ten measured once in smoke mode on
the bundled model (a verdict, a figure and values each; the server and every engine thread gone
afterwards), and the decision rules behind the verdicts on synthetic samples, both outcomes."""

from __future__ import annotations

import socket
import threading

import pytest

from workbench.bench import claims as lab
from workbench.bench.claims import serving_rules as rules
from workbench.bench.claims.catalogue import SERVING
from workbench.bench.claims.serving_setup import serving_server

IDS = [c.id for c in SERVING]
OURS = ("workbench-serve", "workbench-engine", "workbench-load")


def _our_threads() -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t.is_alive() and t.name.startswith(OURS))


@pytest.fixture(scope="module")
def smoke(bundled_llm):
    pytest.importorskip("uvicorn")
    pytest.importorskip("httpx")
    import torch

    before = _our_threads()
    threads = torch.get_num_threads()
    # one torch thread, as `workbench claims` measures here: the engine, the server's loop and the load
    # generator share the two cores, and 2 OpenMP threads stall whenever another thread holds one
    torch.set_num_threads(1)
    try:
        ctx = lab.ClaimContext(mode="smoke", llm=bundled_llm)
        port = serving_server(ctx).port          # the run reuses this server and stops it at the end
        results = lab.run_claims(IDS, ctx=ctx)
    finally:
        torch.set_num_threads(threads)
    return {"results": {r.id: r for r in results}, "ctx": ctx, "port": port, "before": before,
            "after": _our_threads()}


# ---- the claims, measured ------------------------------------------------------------------------
def test_ids_are_the_ten_serving_claims_and_all_cpu():
    assert IDS == ["prefix_ttft_spread", "microbatch_window", "p95_vs_load", "max_tokens_fast_path",
                   "temperature_float", "temperature_zero_top_p", "first_sse_chunk_64b", "ewma_breaker",
                   "priority_header", "concurrency_sweet_spot"]
    assert all(c.device == "cpu" and c.claim and c.source for c in SERVING)


@pytest.mark.parametrize("cid", IDS)
def test_each_claim_gets_a_measured_verdict(smoke, cid):
    r = smoke["results"][cid]
    assert r.error is None, r.values.get("traceback")
    assert r.verdict in (lab.HOLDS, lab.FAILS), (r.verdict, r.reason)
    assert r.figure.strip("- ") and r.reason and r.values
    assert r.to_dict()["values"] is not None            # JSON-ready


def test_the_run_has_no_problems_and_nothing_leaked(smoke):
    assert lab.problems(list(smoke["results"].values())) == []
    assert smoke["after"] == smoke["before"], "a server / engine / load thread outlived run_claims"
    assert "serving.server" not in smoke["ctx"].scratch
    with pytest.raises(OSError):                        # the server's port is closed
        socket.create_connection(("127.0.0.1", smoke["port"]), timeout=1).close()


def test_exact_count_claims_say_what_they_counted(smoke):
    sse = smoke["results"]["first_sse_chunk_64b"].values
    assert sse["lines_parsed_whole"] == sse["data_lines"] > 0       # SSE lines are whole JSON
    assert all(b != 64 for b in sse["first_chunk_bytes"])
    top_p = smoke["results"]["temperature_zero_top_p"].values
    assert top_p["identical_across"] == top_p["completions_across"]  # greedy ignores top_p
    temp = smoke["results"]["temperature_float"].values
    assert temp["float32_equal"] is True


# ---- decision rules on synthetic samples -----------------------------------------------------------
def test_compare_statistic_calls_a_narrower_spread_and_not_an_equal_one():
    wide = [10, 30, 12, 28, 15, 25, 8, 33, 20, 22, 11, 29]
    narrow = [19, 21, 20, 22, 18, 20, 21, 19, 20, 22, 19, 21]
    cmp = rules.compare_statistic(wide, narrow, names=("off", "on"), noise=0.05, metric="sd")
    assert cmp.winner == "on" and cmp.ratio > 3
    same = rules.compare_statistic(wide, list(reversed(wide)), names=("off", "on"), noise=0.05)
    assert same.winner is None and "within noise" in same.verdict
    with pytest.raises(ValueError, match="at least 5"):
        rules.compare_statistic([1, 2, 3], wide)


def test_detectable_ratio_is_the_noise_floor_or_the_runs_spread():
    from workbench.measure.compare import compare_samples

    tight = compare_samples([10.0, 10.1, 10.2], [10.0, 10.1, 10.2], names=("a", "b"), noise=0.05)
    assert rules.detectable_ratio(tight) == pytest.approx(1.05)
    loose = compare_samples([10.0, 15.0, 20.0], [11.0, 14.0, 19.0], names=("a", "b"), noise=0.05)
    assert 1.3 < rules.detectable_ratio(loose, worse="b") <= 2.0


def test_load_knee_finds_the_first_rise_and_none_on_a_flat_curve():
    from workbench.measure.compare import compare_quantile

    low = [100 + i % 5 for i in range(30)]
    flat = [101 + i % 5 for i in range(30)]
    high = [250 + i % 5 for i in range(30)]
    c = lambda b: compare_quantile(low, b, names=("low", "x"), noise=0.05)
    assert rules.load_knee([1, 2, 4], [None, c(flat), c(high)]) == 4
    assert rules.load_knee([1, 2, 4], [None, c(flat), c(flat)]) is None


def _lat(ms: float, n: int = 12) -> list[float]:
    return [ms * (1 + 0.01 * (i % 3)) for i in range(n)]


def test_sweet_spot_is_the_best_throughput_per_latency_inside_the_sweep():
    # 1 user at 100 ms = 10 req/s, 4 at 105 = 38, 8 at 130 = 61.5, 16 at 260 = 61.5: power peaks at 8
    sat = {1: _lat(100), 4: _lat(105), 8: _lat(130), 16: _lat(260)}
    got = rules.sweet_spot([1, 4, 8, 16], sat, noise=0.05)
    assert got["found"] and got["sweet_spot"] == 8 and got["latency_rises"]
    assert got["throughput"][1] == pytest.approx(10 / 1.01, rel=0.02)
    assert got["power"][8] > got["power"][16] and got["power"][8] > got["power"][4]
    # throughput still rising with latency flat: the best power is at the largest level, no sweet spot
    rising = {1: _lat(100), 4: _lat(105), 8: _lat(110), 16: _lat(120)}
    got = rules.sweet_spot([1, 4, 8, 16], rising, noise=0.05)
    assert not got["found"] and got["sweet_spot"] == 16 and "largest level" in got["why"]
    # equal power within the samples' spread: not a sweet spot (2 users at 50 ms and 8 at 100 ms both give 800)
    noisy = {2: [48, 52, 50, 49, 51, 50], 8: [60, 140, 100, 70, 130, 100]}
    assert not rules.sweet_spot([2, 8], noisy, noise=0.05)["found"]
    # too few completed requests: nothing measured
    assert rules.sweet_spot([2, 8], {2: [1.0, 2.0], 8: []}, noise=0.05)["best"] is None


def test_error_rate_breaker_opens_on_errors_only():
    b = rules.ErrorRateBreaker(threshold=0.05, window=20, min_samples=10)
    for i in range(50):
        b.record(False, float(i))
    assert not b.open
    for i in range(3):
        b.record(True, 50.0 + i)
    assert b.open and b.opened_at == 50.0 + 1     # 2 of 20 > 5 %


def test_idle_fraction_counts_waiting_time_without_a_step():
    steps = [  # start, schedule_s, model_s, post_s, num_seqs, waiting
        {"start": 0.000, "schedule_s": 0.0, "model_s": 0.010, "post_s": 0.0, "num_seqs": 1, "waiting": 0},
        {"start": 0.010, "schedule_s": 0.0, "model_s": 0.000, "post_s": 0.0, "num_seqs": 0, "waiting": 1},
        {"start": 0.015, "schedule_s": 0.0, "model_s": 0.000, "post_s": 0.0, "num_seqs": 0, "waiting": 0},
        {"start": 0.020, "schedule_s": 0.0, "model_s": 0.010, "post_s": 0.0, "num_seqs": 2, "waiting": 0},
    ]
    got = rules.idle_fraction(steps)
    assert got["idle_s"] == pytest.approx(0.005) and got["busy_s"] == pytest.approx(0.020)
    assert got["idle_fraction"] == pytest.approx(0.2)


def test_degradation_onset_tolerates_a_queue_that_empties_now_and_then():
    waiting = [0, 0, 1, 0, 0, 0, 2, 3, 0, 4, 5, 6, 0, 7]          # a blip at t=2, then mostly waiting from t=6
    steps = [{"start": float(t), "waiting": w} for t, w in enumerate(waiting)]
    assert rules.degradation_onset(steps, since=0.0, until=13.0) == 6.0
    assert rules.degradation_onset(steps, since=0.0, until=5.0) is None      # before the stretch: only the blip
    assert rules.degradation_onset([{"start": 0.0, "waiting": 0}], since=0.0, until=1.0) is None


def test_sse_report_whole_events_and_cut_ones():
    ev = [b'data: {"choices":[{"text":"a%d"}]}\n\n' % i for i in range(4)] + [b"data: [DONE]\n\n"]
    whole = rules.sse_report(ev)
    assert whole["chunks_one_whole_event"] == 5 and whole["lines_parsed_whole"] == whole["data_lines"] == 5
    assert whole["first_chunk_bytes"] == len(ev[0]) and whole["events"] == 5
    body = b"".join(ev)
    pieces = [body[i:i + 64] for i in range(0, len(body), 64)]        # a 64-byte reader's view
    cut = rules.sse_report(pieces)
    assert cut["first_chunk_bytes"] == 64 and cut["chunks_one_whole_event"] < 5
    assert cut["lines_parsed_whole"] == 5                               # lines rebuilt from the bytes: whole
    assert whole["events_cut_by_read64"] >= 1


def test_context_close_runs_closers_last_first_and_reports_failures():
    ctx = lab.ClaimContext(mode="smoke")
    order = []
    ctx.on_close(lambda: order.append(1))
    ctx.on_close(lambda: (_ for _ in ()).throw(RuntimeError("stuck")))
    ctx.on_close(lambda: order.append(3))
    with pytest.raises(RuntimeError, match="stuck"):
        ctx.close()
    assert order == [3, 1]
    ctx.close()                                        # nothing left: a no-op
