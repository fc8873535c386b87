"""Replays (continuous and static batching) and the scheduler benchmark at small sizes.

The benchmark's numbers are timings of this machine and are not asserted; what is asserted is
what must hold whatever the timing: every request finishes, greedy tokens agree across
configurations, both sides of a ratio are measured in the same run, static batching never admits
while a batch is running.
"""

from __future__ import annotations

import pytest

from workbench.engine.llm import LLM
from workbench.errors import ConfigError
from workbench.engine.sampling import SamplingParams
from workbench.sched import SchedulerConfig
from workbench.engine import LLMEngine, Trace, replay
from workbench.bench.sched import SchedBenchConfig, format_sched_bench, run_sched_bench


@pytest.fixture(scope="module")
def llm():
    return LLM(None, device="cpu")


def _trace(llm, n=6, rate=200.0):
    from workbench.data import heldout_token_windows

    prompts = heldout_token_windows(llm.tokenizer, n, 20, seed=5)
    return Trace.poisson(prompts, rate, n, SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True), seed=1)


def test_static_batching_admits_only_when_idle_and_matches_continuous(llm):
    trace = _trace(llm)
    cont = replay(LLMEngine(llm, scheduler=SchedulerConfig(max_num_seqs=8)), trace)
    stat = replay(LLMEngine(llm, scheduler=SchedulerConfig(max_num_seqs=8)), trace, static_batch=2)
    for res in (cont, stat):
        assert [o.finish_reason for o in res.outputs] == ["length"] * len(trace.requests)
        assert all(len(o.token_ids) == 5 for o in res.outputs)
    assert [o.token_ids for o in cont.outputs] == [o.token_ids for o in stat.outputs]
    st = stat.steps
    assert st["num_seqs"].max() <= 2
    # a request is admitted only in a step where nothing else was running before it
    running_before = st["running"].shift(1, fill_value=0)
    assert (st["admitted"] > 0).sum() >= 3 and (running_before[st["admitted"] > 0] == 0).all()
    assert stat.tokens_per_s > 0 and stat.wall_s > 0


def test_replay_rejects_bad_static_batch(llm):
    with pytest.raises(ConfigError, match="static_batch"):
        replay(LLMEngine(llm), _trace(llm, n=1), static_batch=0)


def test_sched_bench_small(llm):
    cfg = SchedBenchConfig(streams=3, prompt_tokens=16, max_tokens=4, rounds=1, rate=100.0, trace_requests=5,
                           long_prompt_tokens=80, long_every=2, token_budget=32, windows_ms=(0.0, 3.0),
                           overhead_batch=4, overhead_tokens=4)
    res = run_sched_bench(llm, cfg)
    t = res["throughput"]
    assert t["identical_tokens"] is True and t["token_agreement"] == 1.0 and t["max_batch"] == 3
    # both sides measured in this one run (cfg.rounds runs each); the speed-up is a positive
    # finite number that the table prints rounded to two decimals
    assert len(t["runs"]["concurrent"]) == len(t["runs"]["sequential"]) == cfg.rounds
    assert 0 < t["speedup"] < float("inf")
    for key in ("chunked", "window"):
        assert res[f"{key}_identical_tokens"] is True
        for row in res[key]:
            assert row["requests"] == row["finished"] == 5
            assert row["ttft_ms_p95"] >= row["ttft_ms_p50"] > 0
            assert "tokens" not in row
    assert [r["chunked_prefill"] for r in res["chunked"]] == [False, True]
    assert [r["window_ms"] for r in res["window"]] == [0.0, 3.0]
    o = res["overhead"]
    assert o["batch"] == 4 and o["steps"] >= 1 and 0 < o["schedule_share"] < 1
    text = format_sched_bench(res)
    assert f"speed-up {t['speedup']:.2f}x" in text and "scheduler overhead at batch 4" in text


def test_sched_bench_config_errors():
    with pytest.raises(ConfigError, match="streams"):
        SchedBenchConfig(streams=0)
    with pytest.raises(ConfigError, match="windows_ms"):
        SchedBenchConfig(windows_ms=(-1.0,))
    with pytest.raises(ConfigError, match="experiment"):
        run_sched_bench(None, SchedBenchConfig(), experiments=("nope",))


def test_compare_runs_interleaves_replays_and_keeps_every_row(llm):
    from workbench.bench.sched import compare_runs

    cfg = SchedBenchConfig(token_budget=32)
    trace = _trace(llm, n=4)
    cmp = compare_runs(llm, cfg, trace, {"static": dict(static_batch=2), "continuous": {}}, repeats=2,
                       metric="ttft_ms_p95")
    assert [len(cmp.results[k]) for k in ("static", "continuous")] == [2, 2]
    rows = cmp.results["static"] + cmp.results["continuous"]
    assert all(r["finished"] == 4 for r in rows)
    assert all(r["tokens"] == rows[0]["tokens"] for r in rows)       # greedy: the policy never changes tokens
    assert cmp.samples["static"] == [r["ttft_ms_p95"] for r in cmp.results["static"]]
    assert cmp.results["static"][0]["steps_frame"]["num_seqs"].max() <= 2
    assert cmp.winner is None and "2 runs a side" in cmp.verdict      # two replays a side: never a verdict
