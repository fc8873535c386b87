"""Offload tier: evicted prefix blocks spill to host memory or disk and come back on a hit."""

from __future__ import annotations

import pytest
import torch

import workbench
from workbench import SamplingParams
from workbench.kv import BlockManager
from workbench.kv.offload import DiskOffload, HostOffload
from workbench.kv.paged import PagedKVConfig

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", ["host", "disk"])
def test_store_round_trip_capacity_and_verification(kind, dtype, tmp_path):
    shape = (2, 2, 4, 3, 5)
    store = (HostOffload(2, pin=False) if kind == "host"
             else DiskOffload(2, shape, dtype, tmp_path / "kv.bin"))
    blocks = [torch.randn(shape).to(dtype) for _ in range(3)]
    for i, b in enumerate(blocks):
        store.put(100 + i, (i, i), b)
    assert len(store) == 2 and 100 not in store and store.stats.evictions == 1   # LRU dropped the first
    got = store.get(101, (1, 1), torch.device("cpu"))
    assert torch.equal(got, blocks[1])
    assert store.get(102, (9, 9), torch.device("cpu")) is None                   # same key, other tokens
    assert store.get(100, (0, 0), torch.device("cpu")) is None
    nbytes = blocks[0].numel() * blocks[0].element_size()
    assert store.stats.bytes_out == 3 * nbytes and store.stats.bytes_in == nbytes
    assert store.stats.gets == 1 and store.stats.misses == 2 and store.nbytes() == 2 * nbytes


def test_restore_prefix_keeps_invariants():
    bm = BlockManager(4, 2)
    held = {}
    bm.on_evict = lambda bid, h, tokens: held.__setitem__(h, tokens)
    a = list(range(1, 8))                       # 3 full blocks + 1 token
    bm.allocate("a", a)
    bm.commit("a", 7)
    bm.free("a")
    bm.allocate("b", [50, 51, 52, 53, 54, 55, 56])  # needs 4 blocks: evicts all of a's cached ones
    bm.commit("b", 7)
    bm.free("b")
    assert len(held) == 3
    restored = bm.restore_prefix(a, lambda h, t: held.get(h) == t)
    assert [t for _, _, t in restored] == [(1, 2), (3, 4), (5, 6)]
    bm.check_invariants()
    alloc = bm.allocate("a2", a)
    assert alloc.num_cached_tokens == 6 and bm.stats.restored_blocks == 3
    bm.free("a2")
    bm.check_invariants()


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_engine_restores_evicted_prefix_exactly(random_llm, kind):
    cfg = dict(block_size=4, num_blocks=12, enable_prefix_caching=True)
    llm = workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer, kv=PagedKVConfig(**cfg, offload=kind),
                        max_model_len=random_llm.max_model_len)
    plain = workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer, kv=PagedKVConfig(**cfg),
                          max_model_len=random_llm.max_model_len)
    a, b = list(range(10, 41)), list(range(60, 91))   # 31 tokens each: 8 blocks, 7 of them cacheable
    outs = {}
    for name, engine in (("offload", llm), ("plain", plain)):
        first = engine.generate([a], GREEDY)[0]
        engine.generate([b], GREEDY)                  # evicts a's cached blocks from the 12-block pool
        again = engine.generate([a], GREEDY)[0]
        outs[name] = (first, again)
        engine.kv_pool.manager.check_invariants()
        assert engine.kv_pool.manager.num_used_blocks == 0
    first, again = outs["offload"]
    assert again.token_ids == first.token_ids == outs["plain"][0].token_ids
    assert again.num_cached_tokens == 28 and again.prefix_miss_reason is None      # restored: a full hit
    assert outs["plain"][1].num_cached_tokens < 28 and outs["plain"][1].prefix_miss_reason == "evicted"
    st = llm.kv_pool.offload.stats
    per_block = llm.kv_pool.layout.bytes_per_block
    assert st.gets == llm.kv_pool.manager.stats.restored_blocks > 0
    assert st.bytes_in == st.gets * per_block and st.seconds_in > 0 and st.bytes_out >= st.bytes_in


def test_offload_config_is_validated():
    with pytest.raises(workbench.WorkbenchError, match="offload"):
        PagedKVConfig(offload="ssd")
    with pytest.raises(workbench.WorkbenchError, match="enable_prefix_caching"):
        PagedKVConfig(offload="host", enable_prefix_caching=False)


def test_restore_time_on_a_cuda_transport_is_device_time_not_enqueue_time(monkeypatch):
    """On CUDA a restore only enqueues (the compute stream waits on the copy), so a host clock
    reads ~0 and gb_per_s_in is inflated: seconds_in comes from CUDA events (here, fakes)."""
    from fake_cuda import FakeCudaTransport, FakeEvent, install
    from workbench.prefetch.prefetcher import Prefetcher

    calls = install(monkeypatch)
    monkeypatch.setattr(FakeEvent, "elapsed_time", lambda self, end: 250.0)
    shape = (2, 2, 4, 3, 5)
    store = HostOffload(4, prefetcher=Prefetcher(FakeCudaTransport()), block_shape=shape, dtype=torch.float32)
    blocks = [torch.randn(shape) for _ in range(2)]
    for i, b in enumerate(blocks):
        store.put(i, (i,), b)
    for i, b in enumerate(blocks):
        assert torch.equal(store.get(i, (i,), torch.device("cpu")), b)
    st = store.stats
    assert st.gets == 2 and st.seconds_in == pytest.approx(0.5)
    assert st.as_dict()["gb_per_s_in"] == pytest.approx(st.bytes_in / 0.5 / 1e9)
    assert not any(c[0] == "synchronize" for c in calls), "no full-device synchronize per restored block"


def test_pool_restore_time_is_kept_by_the_pool_device_clock(random_llm, monkeypatch):
    """restore_wall_s: the pool's restores are timed by an ElapsedTotal of the pool's device, so
    on a CUDA pool they are event pairs (here, fakes), not host enqueue time."""
    from fake_cuda import FakeEvent, install
    from workbench.measure.timing import ElapsedTotal

    llm = workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer, max_model_len=random_llm.max_model_len,
                        kv=PagedKVConfig(block_size=4, num_blocks=12, enable_prefix_caching=True, offload="host"))
    a, b = list(range(10, 41)), list(range(60, 91))
    llm.generate([a], GREEDY)
    llm.generate([b], GREEDY)                      # a's cached blocks go to the offload tier
    pool = llm.kv_pool
    assert pool._restore_clock.device == pool.device == torch.device("cpu")
    install(monkeypatch)
    monkeypatch.setattr(FakeEvent, "elapsed_time", lambda self, end: 30.0)
    pool._restore_clock = ElapsedTotal("cuda")     # what a CUDA pool makes
    assert llm.generate([a], GREEDY)[0].num_cached_tokens == 28           # restored
    assert pool.restore_seconds == pytest.approx(0.03)
    pool.restore_seconds = 0.0
    assert pool.restore_seconds == 0.0
