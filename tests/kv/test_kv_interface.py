"""The scheduler's KV interface (:class:`workbench.kv.interface.KVManager`): the plain block
manager and the paged pool's ``PoolBlocks`` both implement it, call for call, and
``match_prefix`` says exactly what ``can_allocate`` and ``allocate`` then do."""

from __future__ import annotations

import inspect
import random

import pytest
import torch

from workbench.kv import AllocStatus, BlockManager, KVManager, PrefixMatch
from workbench.kv.paged import PagedKVConfig, PagedKVPool, PoolBlocks
from workbench.model.config import ModelConfig

CFG = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, max_position_embeddings=64)


def _members() -> dict[str, object]:
    """The protocol's public members: name -> function or property."""
    return {n: v for n, v in vars(KVManager).items()
            if not n.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))}


def _pool(num_blocks: int = 8, tensors: bool = False, **kw) -> PagedKVPool:
    return PagedKVPool(CFG, PagedKVConfig(block_size=4, num_blocks=num_blocks, **kw), torch.device("cpu"),
                       torch.float32, 0, tensors=tensors)


def test_the_protocol_lists_the_scheduler_calls():
    assert set(_members()) == {
        "block_size", "num_blocks", "num_available_blocks", "num_cached_blocks", "num_used_blocks", "stats",
        "num_tokens", "block_table", "block_refs", "match_prefix", "cached_prefix_tokens", "can_allocate",
        "allocate", "append_slot", "fork", "commit", "free"}


@pytest.mark.parametrize("cls", [BlockManager, PoolBlocks])
def test_both_implement_every_call_with_the_protocols_signature(cls):
    for name, member in _members().items():
        got = inspect.getattr_static(cls, name, None)
        if isinstance(member, property):
            # a fact: a property, or (the block manager's block_size, num_blocks, stats) set in __init__
            assert isinstance(got, property) or (got is None and cls is BlockManager), (cls.__name__, name)
        else:
            assert inspect.isfunction(got), (cls.__name__, name)
            assert inspect.signature(got) == inspect.signature(member), (cls.__name__, name)
    pool = _pool()
    assert isinstance(BlockManager(4, 4), KVManager) and isinstance(pool.blocks, KVManager)


def test_pool_blocks_forwards_nothing_else():
    assert "__getattr__" not in vars(PoolBlocks) and not hasattr(PoolBlocks, "__getattr__")
    public = {n for n in dir(PoolBlocks) if not n.startswith("_")}
    assert public == set(_members()) | {"manager"}
    pool = _pool()
    blocks = pool.blocks
    for private_or_internal in ("_match", "blocks", "slot_mapping", "take_copies", "prefix_cache"):
        assert not hasattr(blocks, private_or_internal), private_or_internal


def test_match_prefix_cases():
    bm = BlockManager(8, 4)
    prompt = list(range(10))
    assert bm.match_prefix(prompt) == PrefixMatch((), 0, 0)           # nothing committed yet
    a = bm.allocate("a", prompt)
    bm.commit("a", 10)                                                # blocks 0 and 1 full: cached on free
    m = bm.match_prefix(prompt + [99])
    assert m.block_ids == tuple(a.block_table[:2]) and m.cached_tokens == 8 and m.num_blocks == 2
    assert m.unheld == 0                                              # "a" still holds them
    assert bm.match_prefix(prompt + [99], reuse=False) == PrefixMatch((), 0, 0)
    assert bm.match_prefix(prompt[:8]).cached_tokens == 4             # the last token is always computed
    bm.free("a")
    m = bm.match_prefix(prompt + [99])
    assert m.unheld == 2 and all(bm.block_refs(b) == 0 for b in m.block_ids)
    assert bm.match_prefix([5] + prompt[1:]) == PrefixMatch((), 0, 0)  # another first block: no chain
    off = BlockManager(8, 4, enable_prefix_caching=False)
    off.allocate("a", prompt)
    off.commit("a", 10)
    off.free("a")
    assert off.match_prefix(prompt) == PrefixMatch((), 0, 0)


def _random_step(m, rng: random.Random, live: list[str], n: int, base: list[int]) -> None:
    """One random change: allocate a prompt sharing a prefix with ``base`` sometimes, grow, fork,
    commit or free a sequence."""
    op = rng.random()
    if op < 0.35 or not live:
        sid = f"s{n}"
        prompt = base[:rng.randint(0, len(base))] + [rng.randint(0, 5) for _ in range(rng.randint(1, 9))]
        if m.allocate(sid, prompt, rng.random() < 0.9) is not None:
            live.append(sid)
    elif op < 0.5:
        sid = rng.choice(live)
        m.append_slot(sid, rng.randint(0, 5))
    elif op < 0.57:
        child = f"s{n}"
        m.fork(rng.choice(live), child)
        live.append(child)
    elif op < 0.72:
        sid = rng.choice(live)
        m.commit(sid, m.num_tokens(sid))
    else:
        sid = live.pop(rng.randrange(len(live)))
        m.free(sid)


@pytest.mark.parametrize("make", [lambda: BlockManager(10, 4), lambda: _pool(10),
                                  lambda: BlockManager(10, 4, eviction="fifo")], ids=["manager", "pool", "fifo"])
def test_match_prefix_agrees_with_can_allocate_and_allocate(make):
    for seed in range(12):
        rng = random.Random(seed)
        owner, live = make(), []
        m = owner.blocks if isinstance(owner, PagedKVPool) else owner     # (the pool holds its PoolBlocks)
        base = [rng.randint(0, 5) for _ in range(16)]
        checked = 0
        for n in range(60):
            _random_step(m, rng, live, n, base)
            tables = [m.block_table(s) for s in live]
            for b in range(m.num_blocks):
                assert m.block_refs(b) == sum(t.count(b) for t in tables)
            prompt = base[:rng.randint(0, len(base))] + [rng.randint(0, 5) for _ in range(rng.randint(1, 6))]
            reuse = rng.random() < 0.8
            match = m.match_prefix(prompt, reuse)
            assert match.cached_tokens == m.block_size * match.num_blocks
            assert match.unheld == sum(m.block_refs(b) == 0 for b in match.block_ids)
            if reuse:
                assert m.cached_prefix_tokens(prompt) == match.cached_tokens
            need = -(-len(prompt) // m.block_size)
            fits = need - match.num_blocks + match.unheld <= m.num_available_blocks
            assert (m.can_allocate(len(prompt), prompt, reuse) is AllocStatus.OK) == fits
            if rng.random() < 0.3:                          # and allocate does what the match said
                alloc = m.allocate(f"p{n}", prompt, reuse)
                assert (alloc is not None) == fits
                if alloc is not None:
                    checked += 1
                    live.append(f"p{n}")
                    assert alloc.num_cached_tokens == match.cached_tokens
                    assert tuple(alloc.block_table[:match.num_blocks]) == match.block_ids
        assert checked


def test_pool_blocks_runs_the_pools_lifecycle():
    pool = _pool(8, tensors=True)
    events = []
    pool.listeners.append(lambda event, sid: events.append((event, sid)))
    blocks = pool.blocks
    alloc = blocks.allocate("a", list(range(6)))
    assert pool.admissions["a"]["allocation"] is alloc and pool.manager_seconds > 0
    last = alloc.block_table[-1]
    for t in pool.k_cache + pool.v_cache:
        t[last] = 7.0
    blocks.fork("a", "b")
    assert pool.admissions["b"]["fork_of"] == "a" and blocks.block_refs(last) == 2
    seconds = pool.manager_seconds
    blocks.append_slot("b", 3)                              # a shared partly filled block: copy on write
    assert pool.manager_seconds > seconds
    new = blocks.block_table("b")[-1]
    assert new != last and all(bool((t[new] == 7.0).all()) for t in pool.k_cache + pool.v_cache)
    blocks.commit("a", 6)
    blocks.free("a")
    blocks.free("b")
    assert events == [("begin", "a"), ("begin", "b"), ("step", "a"), ("end", "a"), ("end", "b")]
    assert pool.admissions == {} and blocks.num_used_blocks == 0
    before = blocks.stats
    pool.reset()                                            # a new manager: the facts are the new one's
    assert blocks.manager is pool.manager and blocks.stats is not before and blocks.num_cached_blocks == 0
