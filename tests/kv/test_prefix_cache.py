"""Prefix cache: hit accounting, one scenario per miss reason, eviction order, hash collisions."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest

import workbench.kv.prefix_cache as prefix_cache
from workbench.kv import BlockManager, MissReason

SYSTEM = list(range(100, 112))  # 12 tokens: 3 full blocks of 4


def run(bm: BlockManager, seq_id: str, prompt: list[int], free: bool = True):
    """Allocate, 'prefill' (commit the whole prompt) and optionally free, as an engine would."""
    a = bm.allocate(seq_id, prompt)
    assert a is not None
    bm.commit(seq_id, len(prompt))
    if free:
        bm.free(seq_id)
    bm.check_invariants()
    return a


def cached_contents(bm: BlockManager) -> set[tuple]:
    return {bm.blocks[i].tokens for i, s in enumerate(bm.block_states()) if s == "cached"}


@pytest.mark.parametrize("keep_alive", [False, True])
def test_shared_system_prompt(keep_alive):
    bm = BlockManager(64, 4)
    allocs = [run(bm, f"r{i}", SYSTEM + [i, 200 + i], free=not keep_alive) for i in range(10)]
    assert allocs[0].miss_reason is MissReason.NO_SHARED_PREFIX and allocs[0].num_cached_tokens == 0
    for a in allocs[1:]:   # 14 tokens: 3 blocks reusable before the final token, all hit
        assert a.num_cached_tokens == a.hit_tokens == 12 and a.miss_reason is None
        assert a.block_table[:3] == allocs[0].block_table[:3]
    s = bm.stats
    assert (s.requests, s.prompt_tokens, s.hit_tokens, s.full_hits) == (10, 140, 108, 9)
    assert s.misses == {"no_shared_prefix": 1} and s.hit_rate == pytest.approx(108 / 140)
    json.dumps(s.as_dict())
    if keep_alive:
        assert bm.block_states().count("shared") == 3


def test_disabled():
    bm = BlockManager(64, 4, enable_prefix_caching=False)
    allocs = [run(bm, f"r{i}", SYSTEM + [i, 200 + i]) for i in range(10)]
    assert all(a.miss_reason is MissReason.DISABLED and a.num_cached_tokens == 0 for a in allocs)
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 64
    assert bm.stats.misses == {"disabled": 10} and bm.stats.hit_rate == 0


def test_no_shared_prefix():
    bm = BlockManager(16, 4)
    run(bm, "a", [1, 2, 3, 4, 5, 6])
    assert run(bm, "b", [9, 9, 9, 9, 9]).miss_reason is MissReason.NO_SHARED_PREFIX
    # a partial hit whose next block shares nothing with anything seen after that prefix
    run(bm, "c", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    d = run(bm, "d", [1, 2, 3, 4, 9, 9, 9, 9, 1])
    assert d.num_cached_tokens == 4 and d.miss_reason is MissReason.NO_SHARED_PREFIX


def test_shorter_than_block():
    bm = BlockManager(16, 4)
    run(bm, "a", [1, 2, 9, 9, 5, 5])
    b = run(bm, "b", [1, 2, 7, 7, 6, 6])    # shares 2 tokens: less than a block
    assert b.num_cached_tokens == 0 and b.miss_reason is MissReason.SHORTER_THAN_BLOCK
    run(bm, "c", [1, 2, 3, 4, 5, 6, 7, 8, 0])
    d = run(bm, "d", [1, 2, 3, 4, 5, 6, 0, 0, 1])   # one block, then 2 more shared tokens
    assert d.num_cached_tokens == 4 and d.miss_reason is MissReason.SHORTER_THAN_BLOCK
    # prompts with no full block before the final token can never hit; the reason still tells
    assert run(bm, "e", [1, 2, 4]).miss_reason is MissReason.SHORTER_THAN_BLOCK
    assert run(bm, "f", [1, 2, 3, 4]).miss_reason is MissReason.SHORTER_THAN_BLOCK  # final token computed
    assert run(bm, "g", [8]).miss_reason is MissReason.NO_SHARED_PREFIX
    bm.prefix_cache.min_shared_tokens = 3   # e.g. when every prompt starts with the same BOS token
    assert run(bm, "h", [1, 2, 8, 8, 8]).miss_reason is MissReason.NO_SHARED_PREFIX


def test_evicted_and_recomputed():
    bm = BlockManager(3, 2)
    run(bm, "a", [1, 2, 3])                 # [1 2] cached
    run(bm, "x", [5, 6, 7, 8, 9])           # 3 blocks: the cached one is evicted
    assert bm.stats.evictions == 1
    b = run(bm, "b", [1, 2, 4])
    assert b.num_cached_tokens == 0 and b.miss_reason is MissReason.EVICTED
    c = run(bm, "c", [1, 2, 5])              # b recomputed and committed it: a hit again
    assert c.num_cached_tokens == 2 and c.miss_reason is None


def test_not_computed():
    bm = BlockManager(16, 4)
    bm.allocate("a", SYSTEM + [1])           # in flight: KV not written yet
    b = bm.allocate("b", SYSTEM + [2])
    assert b.num_cached_tokens == 0 and b.miss_reason is MissReason.NOT_COMPUTED
    bm.commit("a", 13)
    c = bm.allocate("c", SYSTEM + [3])
    assert c.num_cached_tokens == 12 and c.miss_reason is None
    bm.check_invariants()
    bm2 = BlockManager(16, 4)                # a request that ended before computing its prompt
    bm2.allocate("a", SYSTEM + [1])
    bm2.free("a")
    assert bm2.num_free_blocks == 16
    assert bm2.allocate("b", SYSTEM + [2]).miss_reason is MissReason.NOT_COMPUTED
    bm2.check_invariants()


def _touch_then_evict_one(eviction: str) -> BlockManager:
    bm = BlockManager(4, 2, eviction=eviction)
    for t in (1, 2, 3):
        run(bm, f"p{t}", [t, t, 9])          # cached: [1 1], [2 2], [3 3] (in that order); 1 free
    assert run(bm, "touch", [1, 1, 8]).num_cached_tokens == 2   # use [1 1] again
    bm.allocate("x", [7, 7, 7])              # 2 blocks: the free one + one eviction
    assert bm.stats.evictions == 1
    return bm


def test_eviction_lru_versus_fifo():
    lru, fifo = _touch_then_evict_one("lru"), _touch_then_evict_one("fifo")
    assert cached_contents(lru) == {(1, 1), (3, 3)}    # least recently used: [2 2]
    assert cached_contents(fifo) == {(2, 2), (3, 3)}   # first cached: [1 1], though just used
    assert lru.allocate("q", [2, 2, 0]).miss_reason is MissReason.EVICTED
    assert fifo.allocate("q", [1, 1, 0]).miss_reason is MissReason.EVICTED


def test_lru_evicts_the_tail_of_a_prefix_first():
    for eviction, hit in (("lru", 2), ("fifo", 0)):
        bm = BlockManager(3, 2, eviction=eviction)
        run(bm, "a", [1, 2, 3, 4, 5])        # [1 2] [3 4] cached, [5] freed
        bm.allocate("x", [9, 9, 9])          # one eviction
        bm.free("x")
        b = run(bm, "b", [1, 2, 3, 4, 0])
        assert b.num_cached_tokens == hit and b.miss_reason is MissReason.EVICTED


def test_hash_collision_never_returns_wrong_blocks(monkeypatch):
    monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: 0)
    bm = BlockManager(8, 2)
    a = run(bm, "a", [1, 2, 7], free=False)
    b = run(bm, "b", [3, 4, 7], free=False)  # same hash, other tokens: not reused
    assert b.num_cached_tokens == 0 and b.block_table[0] != a.block_table[0]
    # same tokens at another depth: block (1, 2) after (1, 2) is NOT the cached block (1, 2)
    # at position 0, although hash and tokens match — its parent differs
    c = run(bm, "c", [1, 2, 1, 2, 9], free=False)
    assert c.num_cached_tokens == 2 and c.block_table[0] == a.block_table[0]
    assert c.block_table[1] != a.block_table[0]


@pytest.mark.parametrize("constant_hash", [False, True])
def test_random_traffic_reads_only_its_own_kv(monkeypatch, constant_hash):
    """Fake KV memory (slot -> prefix written there): every reused slot holds the request's own
    prefix. Small alphabet and pool, so prefixes collide and blocks are evicted often."""
    if constant_hash:
        monkeypatch.setattr(prefix_cache, "block_hash", lambda parent, tokens: 0)
    rng = random.Random(0)
    bm, memory, live = BlockManager(10, 2), {}, []
    for i in range(300):
        prompt = [rng.randrange(2) for _ in range(rng.randrange(1, 9))]
        a = bm.allocate(f"r{i}", prompt)
        if a is None:
            bm.free(live.pop(0))
            continue
        for pos, slot in enumerate(bm.slot_mapping(f"r{i}", 0, a.num_cached_tokens)):
            assert memory[slot] == tuple(prompt[:pos + 1])
        for pos, slot in enumerate(bm.slot_mapping(f"r{i}", a.num_cached_tokens, len(prompt)),
                                   start=a.num_cached_tokens):
            memory[slot] = tuple(prompt[:pos + 1])
        bm.commit(f"r{i}", len(prompt))
        live.append(f"r{i}")
        if len(live) > 2:
            bm.free(live.pop(rng.randrange(len(live))))
        bm.check_invariants()
    assert bm.stats.hit_tokens > 0 and bm.stats.evictions > 0


def test_block_hash_is_stable_across_processes():
    """Python's hash() of str/bytes is salted per process; block_hash must not be."""
    here = prefix_cache.block_hash(prefix_cache.block_hash(None, (1, 2, 3)), (4, 5, 6))
    code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('pc', sys.argv[1]); "
            "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
            "print(m.block_hash(m.block_hash(None, (1, 2, 3)), (4, 5, 6)))")
    for seed in ("1", "2"):
        out = subprocess.run([sys.executable, "-c", code, prefix_cache.__file__], capture_output=True, text=True,
                             env=dict(os.environ, PYTHONHASHSEED=seed), check=True).stdout
        assert int(out) == here
    assert prefix_cache.block_hash(None, (1, 2)) != prefix_cache.block_hash(None, (2, 1))
    assert prefix_cache.block_hash(None, (1, 2)) != prefix_cache.block_hash(0, (1, 2))
