"""AsyncEngine and LLMEngine robustness: request ids in use, failed steps, a dead or stopped
engine thread, and constructor arguments that cannot apply to an already loaded LLM.

Runs on the small random model (``random_llm``): these tests are about bookkeeping, not text.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from workbench.errors import ConfigError
from workbench.engine.sampling import SamplingParams
from workbench.sched import SchedulerConfig
from workbench.engine import AsyncEngine, LLMEngine

PROMPT = "The list type"


class Collect:
    """A callback that records events and says when the final one came."""

    def __init__(self) -> None:
        self.events: list = []
        self.done = threading.Event()

    def __call__(self, ev) -> None:
        self.events.append(ev)
        if ev.finished:
            self.done.set()

    def final(self, timeout: float = 10.0):
        assert self.done.wait(timeout), f"no final event within {timeout} s: {self.events}"
        return self.events[-1]


def wait_for(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def fail_once(eng: LLMEngine, exc: BaseException) -> dict:
    """Make the runner's next execute() raise ``exc`` (once, when armed)."""
    orig, flag = eng.runner.execute, {"armed": True}

    def execute(*args, **kw):
        if flag["armed"]:
            flag["armed"] = False
            raise exc
        return orig(*args, **kw)

    eng.runner.execute = execute
    return flag


# ---- 1. a request id in use --------------------------------------------------------------------------
def test_duplicate_request_id_refused_in_the_callers_thread(random_llm):
    eng = LLMEngine(random_llm)
    with AsyncEngine(eng) as a:
        first = Collect()
        params = SamplingParams(max_tokens=20, ignore_eos=True)
        a.submit(PROMPT, params, first, 0, "dup")
        second = Collect()
        with pytest.raises(ConfigError, match="already in use"):
            a.submit(PROMPT, params, second, 0, "dup")
        ev = first.final()
        assert ev.finish_reason == "length" and len([e for e in first.events if e.token_id >= 0]) == 20
        assert second.events == []
        assert a.alive and a.last_error is None
        wait_for(lambda: not eng.seqs)
        assert eng.pool.manager.num_used_blocks == 0
        again = Collect()                           # the id is free again once its request ended
        a.submit(PROMPT, SamplingParams(max_tokens=2), again, 0, "dup")
        assert again.final().finish_reason == "length"


def test_failed_add_does_not_release_the_running_request_of_that_id(random_llm):
    """An add that the engine refuses (its id is in use by a request the engine holds) answers its
    caller with an error; the running request is untouched and the engine thread carries on."""
    eng = LLMEngine(random_llm)
    eng.add_request(PROMPT, SamplingParams(max_tokens=30, ignore_eos=True), request_id="held")
    out = eng.get_output("held")                    # filled in place as it runs
    with AsyncEngine(eng) as a:
        with pytest.raises(ConfigError, match="already in use"):
            a.submit(PROMPT, SamplingParams(max_tokens=2), Collect(), 0, "held")
        late = Collect()                            # past the check (as a racing submit would be)
        with a._cv:
            a._callbacks["held"] = late
            a._inbox.append(("add", "held", PROMPT, SamplingParams(max_tokens=2), 0, eng.clock()))
            a._cv.notify()
        ev = late.final()
        assert ev.finish_reason == "error" and "already in use" in ev.error
        wait_for(lambda: not eng.has_unfinished())
        assert a.alive and a.last_error is None
        assert out.finish_reason == "length" and len(out.token_ids) == 30   # ran to its end
        wait_for(lambda: "held" not in eng.seqs)    # released once finished (nobody waits for it)
        other = Collect()
        a.submit(PROMPT, SamplingParams(max_tokens=2), other)
        assert other.final().finish_reason == "length"


# ---- 2. a failed step keeps the events it took ----------------------------------------------------------
def test_failed_step_keeps_pending_rejections(random_llm):
    eng = LLMEngine(random_llm, scheduler=SchedulerConfig(max_queue_len=1))
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    eng.add_request(PROMPT, params, request_id="A")
    eng.add_request(PROMPT, params, request_id="B")          # the queue is full: rejected, event pending
    fail_once(eng, RuntimeError("device lost (simulated)"))
    events = {e.request_id: e for e in eng.step()}           # the failed step ends its request, nothing raises
    assert {rid: e.finish_reason for rid, e in events.items()} == {"A": "error", "B": "rejected"}
    assert "queue full" in events["B"].error and "simulated" in events["A"].error
    assert isinstance(eng.last_step_error, RuntimeError)
    eng.add_request(PROMPT, params, request_id="C")
    outs = {}
    while eng.has_unfinished():                              # the engine is usable after the failure
        for ev in eng.step():
            if ev.finished:
                outs[ev.request_id] = ev.finish_reason
    assert outs == {"C": "length"}


def test_async_failed_step_ends_every_request_including_rejected(random_llm):
    eng = LLMEngine(random_llm, scheduler=SchedulerConfig(max_queue_len=1))
    a = AsyncEngine(eng)
    params = SamplingParams(max_tokens=50, ignore_eos=True)
    cbs = {rid: Collect() for rid in "ABC"}
    for rid in "ABC":                                        # queued before start: one turn applies all three
        a.submit(PROMPT, params, cbs[rid], 0, rid)
    fail_once(eng, RuntimeError("CUDA out of memory (simulated)"))
    try:
        a.start()
        finals = {rid: cb.final() for rid, cb in cbs.items()}
        assert finals["A"].finish_reason == "error" and "simulated" in finals["A"].error
        assert {finals["B"].finish_reason, finals["C"].finish_reason} == {"rejected"}
        assert "simulated" in a.last_error and a.alive
        wait_for(lambda: not eng.seqs and not a._callbacks)
        assert eng.pool.manager.num_used_blocks == 0
        d = Collect()
        a.submit(PROMPT, SamplingParams(max_tokens=3), d)
        assert d.final().finish_reason == "length"
    finally:
        a.stop()


# ---- 3. the engine thread gone ----------------------------------------------------------------------
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_stream_ends_when_the_engine_thread_dies(random_llm):
    eng = LLMEngine(random_llm)
    a = AsyncEngine(eng, liveness_check_s=0.05).start()

    def die():
        raise SystemExit("the engine thread is killed (simulated)")   # not caught by the loop

    eng.step = die

    async def consume():
        return [ev async for ev in a.stream(PROMPT, SamplingParams(max_tokens=20, ignore_eos=True))]

    events = asyncio.run(asyncio.wait_for(consume(), timeout=10))
    assert events[-1].finished and events[-1].finish_reason == "error"
    assert "not running" in events[-1].error
    assert not a.alive
    with pytest.raises(ConfigError, match="not running"):
        a.submit(PROMPT, SamplingParams(max_tokens=2), Collect())
    a.stop()


def test_stop_fails_pending_requests(random_llm):
    eng = LLMEngine(random_llm)
    a = AsyncEngine(eng)
    queued = Collect()
    a.submit(PROMPT, SamplingParams(max_tokens=2), queued)   # before start(): waits for the thread
    a.stop()                                                 # never started: still answered
    ev = queued.final(1.0)
    assert ev.finish_reason == "error" and "stopped" in ev.error
    with pytest.raises(ConfigError, match="stopped"):
        a.submit(PROMPT, SamplingParams(max_tokens=2), Collect())

    a.start()                                                # start() again after stop() works
    running = Collect()
    a.submit(PROMPT, SamplingParams(max_tokens=100_000, ignore_eos=True), running)
    wait_for(lambda: any(e.token_id >= 0 for e in running.events))
    a.stop()
    ev = running.final(1.0)
    assert ev.finish_reason == "error" and "stopped" in ev.error
    assert not eng.has_unfinished() and eng.pool.manager.num_used_blocks == 0


def test_submit_before_start_is_lazy(random_llm):
    eng = LLMEngine(random_llm)
    a = AsyncEngine(eng)
    cb = Collect()
    rid = a.submit(PROMPT, SamplingParams(max_tokens=2), cb)
    # nothing runs before start(): no thread, the request waits in the inbox, the engine never saw it
    assert a._thread is None and not a.alive
    assert [item[:2] for item in a._inbox] == [("add", rid)] and not eng.seqs and not eng.step_records
    assert cb.events == []
    with a:
        assert cb.final().finish_reason == "length"


def test_on_step_hook_sees_every_step_and_can_hold_the_engine(random_llm):
    """``on_step(stats)`` runs on the engine thread after each step with the fresh snapshot; while
    it runs the engine waits (a test can hold it at a known step); a hook that raises is reported
    in ``last_error`` and the engine carries on."""
    eng = LLMEngine(random_llm)
    seen, release = [], threading.Event()

    def hook(stats):
        seen.append(stats)
        if len(seen) == 1:
            release.wait(30)                                 # held after its first step

    a = AsyncEngine(eng, on_step=hook)
    with a:
        cb = Collect()
        a.submit(PROMPT, SamplingParams(max_tokens=5, ignore_eos=True), cb)
        wait_for(lambda: seen)
        assert len(eng.step_records) == 1 and seen[0]["running"] == 1 and seen[0]["kv_used_blocks"] > 0
        assert a.stats() == seen[0] and not cb.done.is_set()
        release.set()
        assert cb.final().finish_reason == "length"
        wait_for(lambda: len(seen) == len(eng.step_records))   # the final event comes before its step's hook
        a.on_step = lambda stats: 1 / 0
        again = Collect()
        a.submit(PROMPT, SamplingParams(max_tokens=2), again)
        assert again.final().finish_reason == "length" and a.alive
        assert "on_step hook failed" in a.last_error and "ZeroDivisionError" in a.last_error
    assert [s["steps"] for s in seen] == [r.step for r in list(eng.step_records)[:len(seen)]] == [1, 2, 3, 4, 5]
    assert len(seen) == 5                                    # one prefill step and four decode steps


# ---- 8. arguments that cannot apply to a loaded LLM --------------------------------------------------
@pytest.mark.parametrize("kw", [{"max_model_len": 8}, {"device": "cpu"}, {"dtype": torch.float16},
                                {"tokenizer": "some/folder"}])
def test_load_arguments_with_a_loaded_llm_are_refused(random_llm, kw):
    name = next(iter(kw))
    with pytest.raises(ConfigError, match=name):
        LLMEngine(random_llm, **kw)


def test_loaded_llm_without_load_arguments_is_used_as_is(random_llm):
    eng = LLMEngine(random_llm, scheduler=SchedulerConfig(max_num_seqs=2))
    assert eng.llm is random_llm and eng.llm.max_model_len == random_llm.max_model_len
