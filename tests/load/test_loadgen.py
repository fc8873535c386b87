"""The load generator: arrival processes, stages, bounds, targets (HTTP SSE and in-process),
error / rejection accounting, summaries, JSON, observers and the live views.

Timed runs use 5-20 ms fake latencies; the ones whose assertions depend on timing (schedules,
queues, deadlines, redraw rates) run on a virtual clock (``virtual_time``: the same numbers on
any machine, loaded or not); count and rate checks on arrival processes are done on the pure
schedule functions (no clock at all).  Runs against the real engine order their events with
explicit synchronisation (the engine's ``on_step`` hook, ``LoadRun.stop()``), not sleeps.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import re
import sys
import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from workbench.errors import ConfigError
from workbench.load import (CallableTarget, FakeTarget, HTTPTarget, LoadConfig, LoadResult, LoadRun,
                            RequestRecord, Schedule, TokenEvent, arrival_offsets, parse_sse_chunk, run_load,
                            run_load_sync)

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # virtual_time, also under --import-mode=importlib
from virtual_time import VirtualTime  # noqa: E402

PROMPTS = ["alpha", "beta", "gamma"]


def fast_target(**kw) -> FakeTarget:
    return FakeTarget(**{"ttft_s": 0.01, "token_delay_s": 0.005, "capacity": 4, **kw})


def run_virtual(cfg: LoadConfig, observers=(), **fake) -> tuple[LoadResult, FakeTarget]:
    """Run ``cfg`` against ``fast_target(**fake)`` on a virtual clock: exact times, no waiting."""
    with VirtualTime() as vt:
        target = fast_target(clock=vt.clock, **fake)
        res = vt.run(LoadRun(target, cfg, observers, clock=vt.clock).arun())
    return res, target


# ---- arrival processes (pure: no clock) --------------------------------------------------------------
def test_constant_arrivals_are_evenly_spaced():
    offs = list(arrival_offsets(Schedule.from_stages([(2.0, 10)], start=10), "constant"))
    assert len(offs) == 20
    np.testing.assert_allclose(offs, np.arange(20) / 10, atol=1e-9)


def test_poisson_arrivals_are_seeded_and_have_the_right_rate():
    sched = Schedule.from_stages([(2000.0, 5)], start=5)
    a = list(arrival_offsets(sched, "poisson", seed=7))
    assert a == list(arrival_offsets(sched, "poisson", seed=7))
    assert a != list(arrival_offsets(sched, "poisson", seed=8))
    # N ~ Poisson(10000): within 4 sigma; gaps ~ Exp(5): mean 0.2, coefficient of variation 1
    assert abs(len(a) - 10_000) < 4 * 100
    gaps = np.diff(a)
    assert abs(gaps.mean() - 0.2) < 0.01 and abs(gaps.std() / gaps.mean() - 1) < 0.05


def test_stages_ramp_linearly_and_receive_their_integral():
    sched = Schedule.from_stages([(10, 10), (10, 10), (10, 0)])        # up, peak, cool-down
    assert [sched.value(t) for t in (0, 5, 10, 15, 25, 30)] == [0, 5, 10, 10, 5, 0]
    assert [s.name for s in sched.segments] == ["0: ramp-up 0->10", "1: hold 10", "2: cool-down 10->0"]
    per_stage = collections.Counter(sched.stage_at(t) for t in arrival_offsets(sched, "constant"))
    assert [per_stage[k] for k in range(3)] == [50, 100, 50]           # the area under each stage
    # first half of the ramp gets a quarter of its requests (rate grows linearly)
    assert sum(1 for t in arrival_offsets(sched, "constant") if t < 5) == 13   # ceil(12.5)
    long = Schedule.from_stages([(100, 10), (100, 10), (100, 0)])
    poisson = collections.Counter(long.stage_at(t) for t in arrival_offsets(long, "poisson", seed=3))
    for k, expect in ((0, 500), (1, 1000), (2, 500)):
        assert abs(poisson[k] - expect) < 4 * math.sqrt(expect)


def test_closed_loop_user_activation_follows_the_ramp():
    sched = Schedule.from_stages([(4, 4), (2, 4), (4, 0)])
    assert sched.first_time_above(0, 0.0) == pytest.approx(0.0, abs=1e-5)   # user 0 starts at once
    assert sched.first_time_above(2, 0.0) == pytest.approx(2.0, abs=1e-5)   # user 2 when the ramp passes 2
    assert sched.first_time_above(3, 5.0) == pytest.approx(5.0)
    assert sched.first_time_above(3, 7.5) is None                          # ramping down: never again


@pytest.mark.parametrize("kw, field", [
    ({"mode": "burst"}, "mode"), ({"mode": "poisson"}, "rate"), ({"mode": "closed"}, "concurrency"),
    ({"rate": 5}, "max_requests"), ({"rate": 5, "max_requests": 0}, "max_requests"),
    ({"stages": [(0, 5)]}, "stages[0].duration_s"), ({"stages": [(1, -1)]}, "stages[0].target"),
    ({"mode": "closed", "stages": [(1, 2.5)]}, "stages"),
    ({"rate": 1, "max_requests": 1, "max_tokens": 0}, "max_tokens"),
    ({"rate": 1, "max_requests": 1, "prompts": "one string"}, "prompts"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=re.escape(f"LoadConfig.{field}=")):
        LoadConfig(**kw)


# ---- runs against the fake model -----------------------------------------------------------------------
def test_closed_loop_never_exceeds_its_concurrency():
    target = fast_target(capacity=16)
    res = run_load_sync(target, LoadConfig(mode="closed", concurrency=3, max_requests=12, max_tokens=4,
                                           prompts=PROMPTS))
    assert [r.status for r in res.records] == ["ok"] * 12
    assert target.max_running == 3                          # reached, never exceeded
    assert {r.user for r in res.records} == {0, 1, 2}
    assert all(r.output_tokens == 4 and len(r.itl) == 3 for r in res.records)
    by_user = collections.defaultdict(list)
    for r in res.records:
        by_user[r.user].append(r)
    for rs in by_user.values():                             # a user sends only after its last reply
        assert all(b.sent >= a.end - 1e-6 for a, b in zip(rs, rs[1:]))


def test_open_loop_counts_rates_and_queueing():
    res, target = run_virtual(LoadConfig(mode="constant", rate=100, max_requests=10, max_tokens=3, prompts=PROMPTS),
                              capacity=1, ttft_s=0.01, token_delay_s=0.004)
    assert len(res.records) == 10 and res.summary().loc["all", "ok"] == 10
    np.testing.assert_allclose([r.scheduled for r in res.records], np.arange(10) / 100, atol=1e-9)
    # the generator keeps its schedule: each request is sent at its arrival time (virtual clock: exactly)
    np.testing.assert_allclose([r.sent for r in res.records], [r.scheduled for r in res.records], atol=1e-9)
    ttft = [r.ttft for r in res.records]
    # one slot, 18 ms per request, one arrival every 10 ms: the queue (and TTFT) grows by 8 ms a request
    np.testing.assert_allclose(ttft, 0.010 + 0.008 * np.arange(10), atol=1e-9)
    assert [target.priorities[i] for i in range(3)] == [0, 0, 0]


def test_run_ends_when_its_time_is_up_while_requests_close_their_streams():
    """A request whose stream had finished and was closing (an HTTP connection) when the run's time
    was up once swallowed the cancellation: the closed-loop user awaiting it carried on sending,
    and the run never ended (notebook 06's serving claims served 10,000 requests in 10 min)."""
    sends = []

    async def slow_close(prompt, max_tokens, priority=0, **sampling):
        sends.append(vt.clock())
        if len(sends) > 100:                   # the run went on past its end: fail instead of spinning
            asyncio.get_running_loop().stop()
        try:
            await asyncio.sleep(0.01)
            yield {"time": vt.clock(), "finished": True, "finish_reason": "length"}
        finally:
            await asyncio.sleep(0.1)           # closing takes 100 ms: every user is closing at 0.25 s

    cfg = LoadConfig(mode="closed", concurrency=4, max_tokens=1, max_duration_s=0.25, prompts=PROMPTS)
    with VirtualTime() as vt:
        res = vt.run(LoadRun(CallableTarget(slow_close), cfg, clock=vt.clock).arun())
    # each user: 10 ms streaming + 100 ms closing a request; its 3rd (sent at 0.22 s) is closing at 0.25 s
    assert len(sends) == 12 and max(sends) == pytest.approx(0.22)
    assert res.duration_s == pytest.approx(0.25)
    assert [r.status for r in res.records] == ["ok"] * 12       # each had finished: recorded as it ended
    assert collections.Counter(r.user for r in res.records) == {0: 3, 1: 3, 2: 3, 3: 3}


def test_stages_recorded_per_request():
    # a virtual clock: on the real one a loaded machine moved a request across a stage boundary (6, 9, ...)
    res, _ = run_virtual(LoadConfig(mode="constant", stages=[(0.2, 50), (0.2, 50), (0.2, 0)], max_tokens=2,
                                    prompts=PROMPTS))
    s = res.summary()
    assert list(s.index) == ["0: ramp-up 0->50", "1: hold 50", "2: cool-down 50->0", "all"]
    assert list(s["requests"]) == [5, 10, 5, 20]
    assert s.loc["1: hold 50", "offered_qps"] == pytest.approx(50, rel=0.01)
    assert list(s["target"])[:3] == [50, 50, 0]


def test_max_duration_cancels_in_flight_and_records_them():
    cfg = LoadConfig(mode="constant", rate=50, max_duration_s=0.25, max_tokens=100, prompts=PROMPTS)
    res, _ = run_virtual(cfg, capacity=2, token_delay_s=0.01)
    status = collections.Counter(r.status for r in res.records)
    assert status["ok"] == 0 and set(status) == {"cancelled"}
    assert all("max_duration_s" in r.reason for r in res.records)
    assert res.duration_s == pytest.approx(0.25)          # ended at the deadline, not when the requests would
    # arrivals are scheduled at 0, 20, ..., 240 ms: all 13 sent, none scheduled after the deadline
    assert sorted(r.id for r in res.records) == list(range(13))
    assert all(r.scheduled < 0.25 for r in res.records)
    assert res.summary().loc["all", "cancelled"] == len(res.records)


def test_stop_ends_the_run_like_max_duration():
    """``run.stop()`` (here from an observer, at the first finished request) stops sending and
    cancels what is in flight, saying so in the reason."""
    cfg = LoadConfig(mode="constant", rate=100, max_requests=50, max_tokens=3, prompts=PROMPTS)
    first_end = []

    def stop_at_first(run, record):
        if record is not None and not first_end:
            first_end.append(run.elapsed())
            run.stop()

    res, _ = run_virtual(cfg, [stop_at_first], capacity=8)
    status = collections.Counter(r.status for r in res.records)
    assert status["ok"] == 1 and status["cancelled"] >= 1 and set(status) == {"ok", "cancelled"}
    assert len(res.records) < 50 and res.duration_s == pytest.approx(first_end[0])
    assert all("stop()" in r.reason for r in res.records if r.status == "cancelled")


def test_max_requests_bounds_the_count():
    res = run_load_sync(fast_target(), LoadConfig(mode="poisson", rate=200, max_requests=7, max_tokens=2,
                                                  prompts=PROMPTS, seed=1))
    assert [r.id for r in res.records] == list(range(7))
    assert [r.stage_name for r in res.records] == ["run"] * 7


def test_errors_and_rejections_are_recorded_with_reasons():
    res, _ = run_virtual(LoadConfig(mode="constant", rate=200, max_requests=9, max_tokens=3, prompts=PROMPTS),
                         capacity=1, max_queue=1, error_every=3, ttft_s=0.02)
    reasons = res.reasons()
    by = {r.status: r for r in res.records}
    assert "rejected" in by and "queue full" in by["rejected"].reason
    assert by["rejected"].ttft is None and by["rejected"].e2e is not None
    assert res.summary().loc["all", "rejected"] == sum(r.status == "rejected" for r in res.records) >= 3
    assert set(reasons["status"]) <= {"rejected", "error"} and reasons["count"].sum() == sum(
        r.status != "ok" for r in res.records)


def test_target_exceptions_and_early_ends_are_errors():
    async def broken(prompt, max_tokens, priority=0, **kw):
        yield TokenEvent(0.0 + __import__("time").perf_counter(), text="x")
        raise RuntimeError("engine blew up")

    class NoFinish:
        async def send(self, prompt, max_tokens, priority=0, **kw):
            yield TokenEvent(__import__("time").perf_counter(), text="x")

    cfg = LoadConfig(mode="constant", rate=100, max_requests=2, max_tokens=2, prompts=PROMPTS)
    res = run_load_sync(CallableTarget(broken), cfg)
    assert [r.status for r in res.records] == ["error", "error"]
    assert res.records[0].reason == "RuntimeError: engine blew up" and res.records[0].output_tokens == 1
    res = run_load_sync(NoFinish(), cfg)
    assert all(r.status == "error" and "without a finished event" in r.reason for r in res.records)


def test_callable_target_accepts_engine_style_events_and_passes_priority_and_sampling():
    seen = []

    class Ev:   # duck-typed like workbench.engine.llm.StreamEvent
        def __init__(self, i, last):
            import time
            self.time, self.text, self.token_id, self.finished = time.perf_counter(), f"<{i}>", i, last
            self.finish_reason = "length" if last else None

    async def engine(prompt, max_tokens, priority=0, **sampling):
        seen.append((prompt, priority, sampling))
        for i in range(max_tokens):
            await asyncio.sleep(0.002)
            yield Ev(i, i == max_tokens - 1)

    cfg = LoadConfig(mode="closed", concurrency=2, max_requests=4, max_tokens=3, prompts=[[1, 2, 3], "text"],
                     priority=lambda i: i % 2, sampling={"temperature": 0})
    res = run_load_sync(CallableTarget(engine), cfg)
    assert all(r.status == "ok" and r.finish_reason == "length" and r.output_tokens == 3 for r in res.records)
    assert sorted(p for _, p, _ in seen) == [0, 0, 1, 1] and all(s == {"temperature": 0} for *_, s in seen)
    assert [r.priority for r in res.records] == [0, 1, 0, 1]
    assert {r.prompt_len for r in res.records} == {3, 4}


def test_default_prompts_come_from_the_heldout_corpus():
    pytest.importorskip("workbench.data").heldout_documents()
    got = []

    async def echo(prompt, max_tokens, priority=0, **kw):
        got.append(prompt)
        yield TokenEvent(__import__("time").perf_counter(), text="x", finished=True)

    run_load_sync(CallableTarget(echo), LoadConfig(mode="constant", rate=500, max_requests=3, num_prompts=2))
    assert len(got) == 3 and got[0] == got[2] != got[1] and all(isinstance(p, str) and len(p) > 50 for p in got)


def test_sync_wrapper_inside_a_running_loop_and_observers():
    calls = {"records": 0, "ticks": 0, "done": 0}
    ticked = asyncio.Event()        # set at the second periodic tick; used on the run's own loop only
    loops = set()

    def observer(run, record):
        loops.add(threading.get_ident())
        if record is not None:
            calls["records"] += 1
            assert run.in_flight >= 0 and run.counts["ok"] <= run.sent
        else:
            calls["ticks"] += 1
            calls["done"] += run.done
            if calls["ticks"] >= 2:
                ticked.set()

    inner = fast_target()

    async def held(prompt, max_tokens, priority=0, **kw):   # no request ends before two ticks came
        await ticked.wait()
        async for ev in inner.send(prompt, max_tokens, priority=priority, **kw):
            yield ev

    async def notebook_cell():   # as in Jupyter: a loop is already running here
        cfg = LoadConfig(mode="constant", rate=40, max_requests=8, max_tokens=3, prompts=PROMPTS, tick_s=0.02)
        return run_load_sync(CallableTarget(held), cfg, observers=[observer])

    res = asyncio.run(notebook_cell())
    assert len(res.records) == 8 and all(r.status == "ok" for r in res.records)
    # two periodic ticks (they released the requests) and the final one, on the run's own thread
    assert calls["records"] == 8 and calls["ticks"] >= 3 and calls["done"] == 1
    assert loops and threading.get_ident() not in loops


def test_async_run_load_and_a_failing_observer_does_not_stop_the_run():
    def bad(run, record):
        raise ValueError("view broke")

    cfg = LoadConfig(mode="constant", rate=100, max_requests=3, max_tokens=2, prompts=PROMPTS)
    with pytest.warns(RuntimeWarning, match="view broke"):
        res = asyncio.run(run_load(fast_target(), cfg, observers=[bad]))
    assert [r.status for r in res.records] == ["ok"] * 3


# ---- summaries and JSON --------------------------------------------------------------------------------
def _record(i, ttft_ms, status="ok", stage=0, n=3, gap_ms=10.0):
    sent = i * 0.01
    times = [sent + ttft_ms / 1e3 + k * gap_ms / 1e3 for k in range(n)] if status == "ok" else []
    return RequestRecord(id=i, stage=stage, stage_name=f"s{stage}", priority=0, scheduled=sent, sent=sent,
                         token_times=times, end=(times[-1] if times else sent + 0.001), status=status,
                         reason=None if status == "ok" else f"{status} because")


def test_summary_percentiles_on_known_data():
    recs = [_record(i, ttft_ms=i + 1, stage=0 if i < 50 else 1) for i in range(100)]
    recs += [_record(100, 0, status="rejected", stage=1), _record(101, 0, status="error", stage=1)]
    res = LoadResult(records=recs, duration_s=2.0, stages=[(0, "s0", 0.0, 1.0, 5.0), (1, "s1", 1.0, 2.0, 5.0)])
    s = res.summary()
    allrow = s.loc["all"]
    assert (allrow["requests"], allrow["ok"], allrow["rejected"], allrow["errors"]) == (102, 100, 1, 1)
    assert allrow["ttft_p50_ms"] == pytest.approx(50.5)        # 1..100 ms, linear interpolation
    assert allrow["ttft_p95_ms"] == pytest.approx(95.05)
    assert allrow["ttft_p99_ms"] == pytest.approx(99.01)
    assert allrow["ttft_jitter_ms"] == pytest.approx(np.std(np.arange(1, 101), ddof=1))
    assert allrow["itl_p50_ms"] == pytest.approx(10) and allrow["itl_jitter_ms"] == pytest.approx(0, abs=1e-9)
    assert allrow["e2e_p50_ms"] == pytest.approx(70.5) and allrow["tpot_p95_ms"] == pytest.approx(10)
    assert allrow["offered_qps"] == pytest.approx(51) and allrow["goodput_qps"] == pytest.approx(50)
    assert allrow["tokens_per_s"] == pytest.approx(150)
    assert s.loc["s0", "ttft_p50_ms"] == pytest.approx(25.5) and s.loc["s1", "requests"] == 52
    # tokens streamed in the stage's window, by any request: s1's last requests stream until ~1.12 s
    assert s.loc["s0", "tokens_per_s"] == pytest.approx(270) and s.loc["s1", "tokens_per_s"] == pytest.approx(30)
    reasons = res.reasons()
    assert set(zip(reasons["status"], reasons["reason"])) == {("rejected", "rejected because"),
                                                              ("error", "error because")}


def test_stage_tokens_per_s_counts_tokens_streamed_in_the_stage_whenever_sent():
    # sent at 0.5 s in stage 0 = [0, 1), its 10 tokens stream during stage 1 = [1, 2)
    late = RequestRecord(id=0, stage=0, stage_name="s0", priority=0, scheduled=0.5, sent=0.5,
                         token_times=[1.05 + 0.1 * i for i in range(10)], end=2.0, status="ok",
                         finish_reason="length")
    res = LoadResult(records=[late], duration_s=2.0, stages=[(0, "s0", 0.0, 1.0, 1.0), (1, "s1", 1.0, 2.0, 0.0)])
    s = res.summary()
    assert s.loc["s0", "tokens_per_s"] == 0 and s.loc["s1", "tokens_per_s"] == pytest.approx(10)
    # requests, latencies and output_tokens stay with the stage that sent them
    assert (s.loc["s0", "requests"], s.loc["s1", "requests"]) == (1, 0)
    assert s.loc["s0", "output_tokens"] == 10 and s.loc["s1", "output_tokens"] == 0
    assert s.loc["s0", "ttft_p50_ms"] == pytest.approx(550)
    assert s.loc["all", "tokens_per_s"] == pytest.approx(5)


def test_stage_token_counts_add_up_to_the_all_row_under_sustained_load():
    # requests sent every 50 ms over 3 stages, each streaming 8 tokens over 0.4 s: many cross a boundary
    recs = []
    for i in range(50):
        sent = i * 0.05
        times = [sent + 0.02 + 0.05 * k for k in range(8)]
        recs.append(RequestRecord(id=i, stage=min(int(sent), 2), stage_name=f"s{min(int(sent), 2)}", priority=0,
                                  scheduled=sent, sent=sent, token_times=times, end=times[-1] + 0.001,
                                  status="ok", finish_reason="length"))
    dur = max(r.end for r in recs)
    res = LoadResult(records=recs, duration_s=dur,
                     stages=[(0, "s0", 0.0, 1.0, 20.0), (1, "s1", 1.0, 2.0, 20.0), (2, "s2", 2.0, 9.0, 20.0)])
    s = res.summary()
    per_stage = (s["tokens_per_s"] * s["duration_s"]).drop("all")
    assert per_stage.sum() == pytest.approx(s.loc["all", "tokens_per_s"] * s.loc["all", "duration_s"]) == 400
    for name, (t0, t1) in {"s0": (0.0, 1.0), "s1": (1.0, 2.0), "s2": (2.0, dur)}.items():
        assert per_stage[name] == pytest.approx(sum(t0 <= t < t1 for r in recs for t in r.token_times))
    assert s.loc[["s0", "s1", "s2"], "requests"].tolist() == [20, 20, 10]


def test_frame_and_json_round_trip(tmp_path):
    res = run_load_sync(fast_target(), LoadConfig(mode="constant", rate=100, max_requests=4, max_tokens=3,
                                                  prompts=PROMPTS, name="smoke"))
    df = res.frame()
    assert len(df) == 4 and {"ttft_ms", "itl_ms", "e2e_ms", "status", "stage", "priority", "send_lag_ms"} <= set(df)
    path = tmp_path / "run.json"
    res.to_json(path)
    doc = json.loads(path.read_text())
    assert doc["config"]["name"] == "smoke" and doc["config"]["prompts"] == "list of 3"
    back = LoadResult.from_json(path)
    assert [r.token_times for r in back.records] == [r.token_times for r in res.records]
    assert back.summary().loc["all", "ttft_p95_ms"] == pytest.approx(res.summary().loc["all", "ttft_p95_ms"])


# ---- the HTTP target (httpx.MockTransport: no sockets) -------------------------------------------------------
def _sse(*objs) -> bytes:
    return b"".join(b"data: " + (o if isinstance(o, bytes) else json.dumps(o).encode()) + b"\n\n" for o in objs)


COMPLETION_STREAM = _sse(
    {"id": "c1", "object": "text_completion", "choices": [{"index": 0, "text": "Hello", "finish_reason": None}]},
    {"id": "c1", "choices": [{"index": 0, "text": "", "finish_reason": None}]},        # a held-back token
    {"id": "c1", "choices": [{"index": 0, "text": " world", "finish_reason": None}]},
    {"id": "c1", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]},
    {"id": "c1", "choices": [], "usage": {"completion_tokens": 3}},
    b"[DONE]") + b": keep-alive comment\n\n"

CHAT_STREAM = _sse(
    {"id": "x", "object": "chat.completion.chunk",
     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]},
    {"id": "x", "choices": [{"index": 0, "delta": {"content": "Hi"}, "finish_reason": None}]},
    {"id": "x", "choices": [{"index": 0, "delta": {"content": " there"}, "finish_reason": None}]},
    {"id": "x", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
    b"[DONE]")


def _mock(handler) -> httpx.MockTransport:
    return httpx.MockTransport(handler)


def _collect(target, prompt="Say hi", **kw):
    async def go():
        return [ev async for ev in target.send(prompt, 8, **kw)]
    return asyncio.run(go())


def test_parse_sse_chunk_rules():
    assert parse_sse_chunk({"choices": [{"text": "a", "finish_reason": None}]}, chat=False) == ("a", 1, None, None)
    assert parse_sse_chunk({"choices": [{"text": "", "finish_reason": "stop"}]}, chat=False) == ("", 0, "stop", None)
    assert parse_sse_chunk({"choices": [{"delta": {"role": "assistant", "content": ""}}]}, chat=True)[1] == 0
    assert parse_sse_chunk({"choices": [{"delta": {"content": "é"}, "finish_reason": "length"}]}, chat=True) == \
        ("é", 1, "length", None)
    assert parse_sse_chunk({"choices": [{"text": "ab", "token_ids": [5, 6]}]}, chat=False)[1] == 2
    assert parse_sse_chunk({"error": {"message": "KV pool exhausted"}}, chat=False)[3] == "KV pool exhausted"


def test_http_completions_stream_request_and_events():
    seen = {}

    def handler(request: httpx.Request):
        seen["url"], seen["headers"], seen["body"] = str(request.url), request.headers, json.loads(request.content)
        return httpx.Response(200, content=COMPLETION_STREAM, headers={"content-type": "text/event-stream"})

    t = HTTPTarget("http://127.0.0.1:8000", model="bundled", api_key="k", transport=_mock(handler))
    evs = _collect(t, [1, 2, 3], priority=2, temperature=0.0)
    assert seen["url"] == "http://127.0.0.1:8000/v1/completions"
    assert seen["body"] == {"model": "bundled", "prompt": [1, 2, 3], "max_tokens": 8, "stream": True,
                            "temperature": 0.0}
    assert seen["headers"]["x-priority"] == "2" and seen["headers"]["authorization"] == "Bearer k"
    assert [(e.text, e.tokens) for e in evs[:-1]] == [("Hello", 1), ("", 1), (" world", 1)]
    assert evs[-1].finished and evs[-1].finish_reason == "length" and evs[-1].error is None
    assert [e.time for e in evs] == sorted(e.time for e in evs)


def test_http_chat_stream():
    def handler(request):
        assert request.url.path == "/v1/chat/completions"
        assert json.loads(request.content)["messages"] == [{"role": "user", "content": "Say hi"}]
        return httpx.Response(200, content=CHAT_STREAM)

    t = HTTPTarget("http://h:1/v1/", model="m", chat=True, transport=_mock(handler))
    evs = _collect(t)
    assert [e.text for e in evs if e.tokens] == ["Hi", " there"]
    assert evs[-1].finished and evs[-1].finish_reason == "stop"
    with pytest.raises(ConfigError, match="chat=True"):
        _collect(t, [1, 2])


@pytest.mark.parametrize("status, rejected", [(429, True), (503, True), (500, False), (400, False)])
def test_http_status_errors_and_rejections(status, rejected):
    def handler(request):
        return httpx.Response(status, json={"error": {"message": f"nope {status}", "type": "x"}})

    evs = _collect(HTTPTarget("http://h:1", model="m", transport=_mock(handler)))
    assert len(evs) == 1 and evs[0].finished and evs[0].rejected is rejected
    assert evs[0].error == f"HTTP {status}: nope {status}"


@pytest.mark.parametrize("body, needle", [
    (_sse({"choices": [{"text": "a", "finish_reason": None}]}), "without 'data: [DONE]'"),
    (_sse({"choices": [{"text": "a"}]}, {"error": {"message": "pool full"}}), "mid-stream: pool full"),
    (b"data: {not json\n\n", "bad SSE data"),
])
def test_http_broken_streams_are_errors(body, needle):
    evs = _collect(HTTPTarget("http://h:1", model="m", transport=_mock(lambda r: httpx.Response(200, content=body))))
    assert evs[-1].finished and needle in evs[-1].error


def test_http_connection_errors_and_load_run_over_http():
    def refuse(request):
        raise httpx.ConnectError("connection refused", request=request)

    evs = _collect(HTTPTarget("http://h:1", model="m", transport=_mock(refuse)))
    assert evs[-1].error.startswith("ConnectError: connection refused")

    async def slow_stream():
        for obj in (COMPLETION_STREAM.split(b"\n\n")):
            await asyncio.sleep(0.005)
            yield obj + b"\n\n"

    calls = collections.Counter()

    def handler(request):
        calls["n"] += 1
        if calls["n"] == 2:
            return httpx.Response(429, json={"error": {"message": "too many requests"}})
        return httpx.Response(200, content=slow_stream())

    t = HTTPTarget("http://h:1", model="m", transport=_mock(handler))
    res = run_load_sync(t, LoadConfig(mode="constant", rate=100, max_requests=4, max_tokens=8, prompts=PROMPTS))
    st = [r.status for r in res.records]
    assert st.count("ok") == 3 and st.count("rejected") == 1
    rej = next(r for r in res.records if r.status == "rejected")
    assert rej.reason == "HTTP 429: too many requests"
    ok = [r for r in res.records if r.status == "ok"]
    assert all(r.output_tokens == 3 and r.finish_reason == "length" and r.ttft > 0.004 for r in ok)


def test_http_target_config_errors():
    with pytest.raises(ConfigError, match="base_url"):
        HTTPTarget("localhost:8000", model="m")
    with pytest.raises(ConfigError, match="model"):
        HTTPTarget("http://localhost:8000", model="")


# ---- live views ------------------------------------------------------------------------------------------
def test_dashboard_follows_a_run_throttled_and_static_figure():
    pytest.importorskip("plotly")
    pytest.importorskip("ipywidgets")
    from workbench.lab.load_views import TRACES, LatencyDashboard

    cfg = LoadConfig(mode="constant", stages=[(0.3, 60), (0.3, 60)], max_tokens=3, prompts=PROMPTS, tick_s=0.05)
    with VirtualTime() as vt:          # the run's and the dashboard's clock: redraw pacing is exact
        target = fast_target(capacity=2, clock=vt.clock)
        run = LoadRun(target, cfg, clock=vt.clock)
        dash = LatencyDashboard(window_s=1.0, max_hz=10, metrics_fn=target.metrics, metrics_hz=10,
                                clock=vt.clock).attach(run)
        res = vt.run(run.arun())
    elapsed = res.duration_s
    assert elapsed >= 0.6
    # ticks every 50 ms, redraws at most every 100 ms, plus the final forced redraw
    assert 2 <= dash.redraws <= elapsed * 10 + 2
    assert all(b - a >= 0.1 - 1e-9 for a, b in zip(dash.data["t"], dash.data["t"][1:-1]))
    d = dash.data
    assert len(d["t"]) == dash.redraws and d["ttft_p95"][-1] > 0
    assert max(v for v in d["in_flight"] if v is not None) >= 1
    assert any(v is not None for v in d["queue_len"]) and "rejected 0" in dash.label.value
    fig = dash.static_figure()
    names = [tr.name for tr in fig.data]
    assert type(fig).__name__ == "Figure" and len(fig.data) == 14 and len(set(names)) == 14
    keys = [k for k, *_ in TRACES]
    assert list(fig.data[keys.index("ttft_p95")].y) == d["ttft_p95"]
    assert list(fig.data[keys.index("itl_p50")].y) == d["itl_p50"] and d["itl_p50"][-1] > 0
    assert dash._poller is None                                       # polling stopped with the run


def test_latency_vs_load_figure_and_prometheus_parsing():
    pytest.importorskip("plotly")
    import pandas as pd

    from workbench.lab.load_views import latency_vs_load_figure
    from workbench.lab.load_views import pick_metrics
    from workbench.lab.prom_metrics import parse_prometheus_text

    df = pd.DataFrame({"window_ms": [0, 0, 5, 5], "offered_qps": [1, 2, 1, 2],
                       "ttft_p50_ms": [10, 20, 12, 15], "ttft_p95_ms": [15, 40, 16, 22]})
    fig = latency_vs_load_figure(df)
    assert len(fig.data) == 4 and fig.data[0].name == "window_ms=0: TTFT P50"
    assert list(fig.data[3].y) == [16, 22]
    with pytest.raises(ConfigError, match="microbatch"):
        latency_vs_load_figure(df, group="microbatch")
    text = ('# HELP x\n# TYPE workbench_queue_len gauge\nworkbench_queue_len 3\n'
            'vllm:num_requests_running{model="m"} 2 1700000000\nworkbench_kv_usage 0.25\ngarbage\n')
    m = parse_prometheus_text(text)
    assert m == {"workbench_queue_len": 3.0, 'vllm:num_requests_running{model="m"}': 2.0, "workbench_kv_usage": 0.25}
    assert pick_metrics(m) == {"queue_len": 3.0, "running": 2.0, "batch_size": None, "kv_usage": 25.0}


# ---- the batched engine in process (EngineTarget) ----------------------------------------------------------
@pytest.fixture(scope="module")
def engine_target():
    from workbench.load import EngineTarget
    from workbench.sched import SchedulerConfig
    from workbench.engine import AsyncEngine, LLMEngine

    eng = LLMEngine(None, device="cpu", scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=128))
    priorities = []
    add = eng.add_request

    def spy(prompt, params=None, request_id=None, priority=0, arrival_time=None):
        priorities.append((priority, params.max_tokens))
        return add(prompt, params, request_id=request_id, priority=priority, arrival_time=arrival_time)

    eng.add_request = spy
    target = EngineTarget(AsyncEngine(eng), temperature=0.0)
    target.spy = priorities
    yield target
    target.close()
    assert not target.aengine._thread                   # it started the engine thread, so it stopped it


class _StopWhenStreaming:
    """A pass-through target that calls ``run.stop()`` once ``n`` requests have streamed a token
    (seen here, on the load generator's loop, so the records have them too) and ``ready`` is set."""

    def __init__(self, target, n: int, ready: threading.Event) -> None:
        self.target, self.n, self.ready, self.run, self.streaming = target, n, ready, None, 0

    async def send(self, prompt, max_tokens, priority=0, **sampling):
        stream = self.target.send(prompt, max_tokens, priority=priority, **sampling)
        first = True
        try:
            async for ev in stream:
                if first and ev.tokens:
                    first = False
                    self.streaming += 1
                    if self.streaming == self.n:
                        assert await asyncio.to_thread(self.ready.wait, 60), "never ready to stop"
                        self.run.stop()
                yield ev
        finally:
            await stream.aclose()


def _pool_drains(engine, timeout: float = 5.0) -> int:
    import time as _time

    deadline = _time.monotonic() + timeout
    busy = lambda: engine.pool.manager.num_used_blocks or engine.scheduler.num_unfinished  # noqa: E731
    while busy() and _time.monotonic() < deadline:
        _time.sleep(0.01)
    return engine.pool.manager.num_used_blocks


def test_engine_target_poisson_run_every_request_ends_and_the_pool_drains(engine_target):
    eng = engine_target.engine
    steps_before = len(eng.step_records)
    cfg = LoadConfig(mode="poisson", stages=[(0.6, 8), (0.6, 8)], max_tokens=4, num_prompts=6, seed=3,
                     priority=lambda i: i % 3, max_duration_s=20)
    res = run_load_sync(engine_target, cfg)
    assert len(res.records) >= 3
    for r in res.records:
        assert r.status in ("ok", "rejected", "error") and (r.status == "ok" or r.reason)
    ok = [r for r in res.records if r.status == "ok"]
    assert len(ok) == len(res.records)                       # a light load: nothing refused
    for r in ok:
        assert 1 <= r.output_tokens <= 4 and (r.output_tokens == 4 or r.finish_reason == "stop")
        assert r.ttft > 0 and all(g >= 0 for g in r.itl) and r.e2e >= r.ttft
        assert r.finish_reason in ("length", "stop")
    # priority and max_tokens reached the engine, request by request
    assert sorted(engine_target.spy[-len(res.records):]) == sorted((r.priority, 4) for r in res.records)
    assert {r.priority for r in res.records} <= {0, 1, 2}
    assert _pool_drains(eng) == 0
    assert len(eng.step_records) > steps_before
    m = engine_target.metrics()
    assert {"queue_len", "running", "batch_size", "kv_usage", "preemptions"} <= set(m)


def test_engine_target_rejections_errors_and_cancellation_free_the_pool(engine_target):
    eng = engine_target.engine
    # a prompt the engine cannot take: an explicit error, nothing submitted
    bad = run_load_sync(engine_target, LoadConfig(mode="constant", rate=50, max_requests=2, max_tokens=2,
                                                  prompts=[[99999]]))
    assert [r.status for r in bad.records] == ["error", "error"]
    assert all("invalid request" in r.reason and "vocabulary" in r.reason for r in bad.records)
    # the engine's admission control refuses: statuses say "rejected", with the engine's reason
    sched_cfg = eng.scheduler.config
    old = sched_cfg.max_queue_len
    sched_cfg.max_queue_len = 0
    try:
        rej = run_load_sync(engine_target, LoadConfig(mode="constant", rate=50, max_requests=3, max_tokens=2,
                                                      prompts=["The list type"]))
    finally:
        sched_cfg.max_queue_len = old
    assert [r.status for r in rej.records] == ["rejected"] * 3
    assert all("engine rejected the request" in r.reason and "queue full" in r.reason for r in rej.records)
    # cut mid-generation: cancelled records, the engine aborts them, every block comes back.  6 users,
    # 4 running at most: the engine is held at the first step after which 4 requests have tokens and 2
    # wait, until the run has ended; the run is stopped once the engine is held and the client has seen
    # 4 requests stream (explicit ordering: none can finish, none is cut before its first token)
    cfg = LoadConfig(mode="closed", concurrency=6, max_requests=6, max_tokens=400, prompts=["The list type"],
                     max_duration_s=120, sampling={"ignore_eos": True})
    holding, ended, released, held = threading.Event(), threading.Event(), threading.Event(), []
    target = _StopWhenStreaming(engine_target, 4, holding)
    run = target.run = LoadRun(target, cfg)
    run.add_observer(lambda r, rec: ended.set() if r.done else None)

    def hold_until_the_run_ended(stats):          # the engine thread, after each step
        sch = eng.scheduler
        if not held and len(sch.running) == 4 and len(sch.waiting) == 2 and \
                all(s.num_generated >= 1 for s in sch.running):
            holding.set()
            held.append(ended.wait(60))           # the engine waits: nothing runs on meanwhile
            released.set()

    engine_target.aengine.on_step = hold_until_the_run_ended
    try:
        cut = run.run()
    finally:
        engine_target.aengine.on_step = None
    records = [(r.status, r.finish_reason, r.output_tokens, r.reason, r.sent, r.end) for r in cut.records]
    assert holding.is_set(), ("the engine never held 4 streaming + 2 waiting requests", records)
    assert released.wait(60) and held == [True], ("the hold did not last until the run ended", records)
    assert [r.status for r in cut.records] == ["cancelled"] * 6, records
    assert all("stop()" in r.reason for r in cut.records), records
    tokens = sorted(r.output_tokens for r in cut.records)
    assert tokens[:2] == [0, 0] and min(tokens[2:]) >= 1, records    # queued ones and streaming ones were cut
    assert _pool_drains(eng) == 0 and not eng.scheduler.running and not eng.scheduler.waiting


def test_engine_target_input_checks():
    from workbench.load import EngineTarget

    with pytest.raises(ConfigError, match="AsyncEngine or LLMEngine"):
        EngineTarget(object())


# ---- the CLI (workbench load) ------------------------------------------------------------------------------
def _cli(argv):
    import argparse

    from workbench.cli.load import add_parser

    ap = argparse.ArgumentParser(prog="workbench")
    add_parser(ap.add_subparsers(dest="command", required=True))
    return ap.parse_args(argv)


def test_cli_stage_and_prompt_parsing(tmp_path):
    from workbench.cli.load import parse_duration, parse_stages, read_prompts

    assert parse_stages("10s:5,30s:20,10s:0") == [(10.0, 5.0), (30.0, 20.0), (10.0, 0.0)]
    assert parse_stages("500ms:2.5, 1m:1,2:0") == [(0.5, 2.5), (60.0, 1.0), (2.0, 0.0)]
    assert parse_duration("1.5") == 1.5
    for bad, needle in (("10s", "duration:target"), ("ten:5", "not a duration"), ("1s:x", "not a number"),
                        ("0s:1", "must be > 0"), ("", "empty")):
        with pytest.raises(ConfigError, match=needle):
            parse_stages(bad)
    (tmp_path / "p.txt").write_text("first prompt\n\nsecond prompt\n")
    (tmp_path / "p.json").write_text('["a", "b"]')
    (tmp_path / "p.jsonl").write_text('{"prompt": "x"}\n"y"\n')
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n{"text": 1}\n')
    assert read_prompts(tmp_path / "p.txt") == ["first prompt", "second prompt"]
    assert read_prompts(tmp_path / "p.json") == ["a", "b"]
    assert read_prompts(tmp_path / "p.jsonl") == ["x", "y"]
    with pytest.raises(ConfigError, match="line 2"):
        read_prompts(tmp_path / "bad.jsonl")
    with pytest.raises(ConfigError, match="no such file"):
        read_prompts(tmp_path / "missing.txt")


def test_cli_parser_and_argument_errors():
    from workbench.cli.load import cmd_load, run_load_command

    args = _cli(["load", "--url", "http://127.0.0.1:1", "--mode", "closed", "--stages", "1s:2",
                 "--max-requests", "5", "--max-seconds", "3", "--priority", "2", "--slo-factor", "2", "--json"])
    assert args.func is cmd_load and args.mode == "closed" and args.max_requests == 5 and args.slo_factor == 2.0
    with pytest.raises(SystemExit):
        _cli(["load", "--mode", "burst"])
    with pytest.raises(ConfigError, match="--served-model-name"):
        run_load_command(url="http://127.0.0.1:1", model="x", stages="1s:1")
    with pytest.raises(ConfigError, match="--max-requests"):
        run_load_command(rate=2)
    with pytest.raises(ConfigError, match="--concurrency"):
        run_load_command(mode="closed", max_requests=3)
    with pytest.raises(ConfigError, match="--slo-factor.*SLOConfig.factor"):
        run_load_command(stages="1s:1", slo_factor=1.0)
    with pytest.raises(ConfigError, match="whole numbers"):
        run_load_command(mode="closed", stages="1s:1.5")
    from workbench.errors import WorkbenchError
    with pytest.raises(WorkbenchError, match="cannot reach the server"):
        run_load_command(url="http://127.0.0.1:1", stages="1s:1")


def test_cli_in_process_run_writes_csv_json_and_prints_the_table(tmp_path, capsys):
    import pandas as pd

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The list type\nA dictionary maps\n")
    args = _cli(["load", "--device", "cpu", "--mode", "constant", "--stages", "0.5s:6,0.5s:6", "--max-tokens", "3",
                 "--prompt-file", str(prompts), "--max-requests", "4", "--max-seconds", "30", "--priority", "1",
                 "--csv", str(tmp_path / "r.csv"), "--out", str(tmp_path / "r.json"), "--quiet",
                 "--slo-factor", "50"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    table = out[out.index("stage "):]
    assert "TTFT p50" in table and "ITL p50" in table and "jitter" in table and table.count("\n") >= 5
    assert "SLO guard: closed, tripped 0 times, shed 0 requests" in out
    assert out.rstrip().splitlines()[-1].startswith("(latencies in ms")      # the table comes last
    df = pd.read_csv(tmp_path / "r.csv")
    assert len(df) == 4 and set(df["status"]) == {"ok"} and set(df["priority"]) == {1}
    assert (df["ttft_ms"] > 0).all() and (df["output_tokens"] <= 3).all()
    back = LoadResult.from_json(tmp_path / "r.json")
    assert len(back.records) == 4 and back.config["max_tokens"] == 3
    row_all = [line for line in table.splitlines() if line.startswith("all")][0].split()
    assert row_all[2] == "4" and row_all[3] == "4"                            # sent, ok
