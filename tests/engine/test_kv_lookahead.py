"""KV lookahead: the engine stages the offloaded prefix blocks of the next waiting requests and the
swapped KV of the next swapped ones.  Greedy tokens do not change (on vs off, swapped vs never
preempted), the prefetcher records hits, aborts give every block back and drop staged data."""

from __future__ import annotations

import pytest

import workbench
from workbench import SamplingParams
from workbench.bench.prefetch_kv import kv_lookahead_experiment
from workbench.engine import LLMEngine
from workbench.kv import BlockManager
from workbench.kv.paged import PagedKVConfig
from workbench.sched import SchedulerConfig
from workbench.sched.scheduler import Scheduler
from workbench.sched.sequence import Sequence

PROMPTS = ["The list data type has some more methods.", "To create a new virtual environment,",
           "The :mod:`logging` module", "A function is", "When an exception is raised, the",
           "Python's for statement iterates over the items of any sequence"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def test_lookahead_on_and_off_give_the_same_tokens_and_on_records_hits(bundled_llm):
    r = kv_lookahead_experiment(bundled_llm, n_requests=8, shared_prefix_tokens=64, n_prefixes=4, max_tokens=2,
                                repeats=1, lookahead=(0, 4))
    assert r["tokens_identical"] and r["config"]["offload"] == "disk"
    off, on = r["modes"][0], r["modes"][4]
    assert off["restored_blocks"] == on["restored_blocks"] > 0            # restores happened, the same ones
    assert off["hits"] == 0 and off["demand"] == off["uses"] == off["restored_blocks"]
    assert off["restore_s_hidden"] == 0 and off["restore_s_on_critical_path"] > 0
    assert on["hits"] > 0 and on["prefetch_hit_rate"] > 0 and on["restore_s_hidden"] > 0
    assert on["bytes"] == off["bytes"] > 0


def test_prefetch_stats_only_with_a_slower_tier(bundled_llm):
    assert LLMEngine(bundled_llm).pool.prefetch_stats() is None
    eng = LLMEngine(bundled_llm, kv=PagedKVConfig(offload="host"))
    st = eng.pool.prefetch_stats()
    assert st["lookahead"] == 4 and st["uses"] == 0 and st["prefetch_hit_rate"] is None
    assert {"stall_s", "bytes", "achieved_gbps", "prefetch_efficiency", "restore_s_on_critical_path",
            "restore_s_hidden"} <= set(st)
    eng.pool.close()


def test_lookahead_config_is_validated():
    assert PagedKVConfig(offload="disk").effective_lookahead == 4
    assert PagedKVConfig(swap_space="host").effective_lookahead == 4
    assert PagedKVConfig().effective_lookahead == 0
    assert PagedKVConfig(offload="disk", lookahead=0).effective_lookahead == 0
    with pytest.raises(workbench.WorkbenchError, match="lookahead"):
        PagedKVConfig(lookahead=2)                      # nothing to prefetch from
    with pytest.raises(workbench.WorkbenchError, match="lookahead"):
        PagedKVConfig(offload="disk", lookahead=-1)
    with pytest.raises(workbench.WorkbenchError, match="swap_space"):
        PagedKVConfig(swap_space="ssd")
    with pytest.raises(workbench.WorkbenchError, match="prefetch_blocks"):
        PagedKVConfig(offload="disk", prefetch_blocks=-3)


def test_scheduler_lookahead_lists_waiting_in_admission_order():
    m = BlockManager(64, 4)
    sch = Scheduler(SchedulerConfig(max_num_seqs=8, aging_s=None), m)
    m.allocate("warm", [1, 2, 3, 4, 5, 6, 7, 8, 9])           # a cached prefix: prefix-aware admission prefers it
    m.commit("warm", 9)
    m.free("warm")
    seqs = [Sequence("a", [50, 51, 52, 53, 54], 5, None, priority=0),
            Sequence("b", [1, 2, 3, 4, 5, 6, 7, 8, 60], 9, None, priority=0),
            Sequence("c", [70, 71], 2, None, priority=1),
            Sequence("d", [80, 81, 82], 3, None, priority=0)]
    for s in seqs:
        sch.add(s)
    waiting, swapped = sch.lookahead(3, now=0.0)
    assert [s.request_id for s in waiting] == ["c", "b", "a"] and swapped == []
    assert sch.lookahead(0, 0.0) == ([], [])
    out = sch.schedule(0.0)                                   # room for all: the same order
    assert [s.request_id for s in out.admitted] == ["c", "b", "a", "d"]


def engine(llm, **kv):
    sched = dict(max_num_seqs=6, max_num_batched_tokens=64, preemption_mode="swap")
    return LLMEngine(llm, scheduler=SchedulerConfig(**sched), kv=PagedKVConfig(**kv))


@pytest.mark.parametrize("swap_space", ["disk", "host"])
def test_swapped_kv_comes_back_identical(bundled_llm, swap_space):
    plain = LLMEngine(bundled_llm, scheduler=SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=64))
    reference = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]      # a pool with room: no preemption
    assert plain.scheduler.num_preemptions == 0
    eng = engine(bundled_llm, block_size=4, num_blocks=14, swap_space=swap_space)   # 56 slots: too few
    outs = eng.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    store = eng.pool.swap_store
    assert eng.scheduler.num_preemptions > 0 and store.stats["swap_ins"] > 0
    assert store.transport.kind == swap_space and len(store) == 0 and not eng.runner.swap_space
    swap = eng.pool.prefetch_stats()["sources"]["swap"]
    assert swap["uses"] > 0 and swap["hits"] > 0 and swap["bytes"] > 0 and swap["staged_now"] == 0
    assert eng.pool.manager.num_used_blocks == 0
    eng.pool.manager.check_invariants()
    eng.pool.close()


def test_abort_mid_flight_returns_every_block_and_drops_staged_data(bundled_llm):
    sched = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=64, preemption_mode="swap", prefix_aware=False)
    kv = PagedKVConfig(block_size=4, num_blocks=24, offload="disk", swap_space="disk", prefetch_blocks=8)
    eng = LLMEngine(bundled_llm, scheduler=sched, kv=kv)
    a, b = list(range(100, 140)), list(range(200, 240))       # two 10-block prefixes
    short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for p in (a + [1], b + [1], list(range(300, 390))):       # the last one evicts both to disk
        eng.generate([p], short)
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    rids = [eng.add_request(a + [i], long) for i in range(2)] + [eng.add_request(b + [i], long) for i in range(3)]
    eng.step()                                    # a's run; b's blocks wait on disk: staged
    st = eng.pool.prefetch_stats()
    assert st["sources"]["offload"]["staged_now"] == 8 == st["sources"]["offload"]["staging_blocks"]   # bounded
    for _ in range(60):                           # until a's requests outgrow the pool: one is swapped out
        eng.step()
        if eng.scheduler.swapped:
            break
    assert eng.scheduler.swapped and len(eng.pool.swap_store) == 1
    assert eng.pool.prefetch_stats()["sources"]["swap"]["staged_now"] > 0
    for rid in rids:                              # waiting, running and swapped ones
        eng.abort(rid)
    eng.drain_events()
    assert eng.pool.manager.num_used_blocks == 0 and not eng.has_unfinished()
    assert len(eng.pool.swap_store) == 0 and eng.pool.prefetch_stats()["staged_now"] == 0
    eng.pool.manager.check_invariants()
    eng.pool.close()
