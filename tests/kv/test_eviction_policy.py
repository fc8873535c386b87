"""BlockManager(eviction=<function>): the candidates a policy sees, the package's two orders written
as policies, a bad choice refused before anything changes, and the hook through PagedKVConfig
into a live engine.  (The state machine of test_block_manager.py runs a policy too.)"""

from __future__ import annotations

import random

import pytest

from workbench.errors import ConfigError, WorkbenchError
from workbench.kv.block_manager import BlockManager, EvictionCandidate, fifo, lru, slots


def snapshot(bm: BlockManager):
    return (bm.block_states(), [b.ref_count for b in bm.blocks], {s: bm.block_table(s) for s in bm._seqs},
            bm.num_free_blocks, bm.num_cached_blocks, [(b.hash, b.hits, b.last_used) for b in bm.blocks],
            dict(bm.prefix_cache.index), dict(bm.prefix_cache.pending), bm.stats.as_dict())


def run(bm: BlockManager, sid: str, prompt: list[int], keep: bool = False):
    a = bm.allocate(sid, prompt)
    if a is not None:
        bm.commit(sid, len(prompt))
        if not keep:
            bm.free(sid)
    bm.check_invariants()
    return a


def random_workload(seed: int, bms: list[BlockManager]) -> None:
    """The same random operations on every manager: prompts from 3 shared heads, some kept running."""
    rnd = random.Random(seed)
    heads = [[rnd.randint(0, 3) for _ in range(rnd.randint(1, 6))] for _ in range(3)]
    live: list[str] = []
    for i in range(40):
        if rnd.random() < 0.6 or not live:
            p = rnd.choice(heads) + [rnd.randint(0, 3) for _ in range(rnd.randint(0, 4))]
            outs = [bm.allocate(f"s{i}", p) for bm in bms]
            assert len({o is None for o in outs}) == 1
            if outs[0] is not None:
                assert len({tuple(o.block_table) for o in outs}) == 1, f"seed {seed}, op {i}: tables differ"
                for bm in bms:
                    bm.commit(f"s{i}", len(p))
                live.append(f"s{i}")
        else:
            sid = live.pop(rnd.randrange(len(live)))
            for bm in bms:
                bm.free(sid)
        for bm in bms:
            bm.check_invariants()
        assert len({tuple(bm.block_states()) for bm in bms}) == 1


@pytest.mark.parametrize("name, policy", [("lru", lru), ("fifo", fifo)])
def test_the_orders_written_as_policies_evict_what_the_heap_evicts(name, policy):
    for seed in range(60):
        heap, fn = BlockManager(8, 2, eviction=name), BlockManager(8, 2, eviction=policy)
        random_workload(seed, [heap, fn])
        assert heap.stats.evictions == fn.stats.evictions
    assert fn.eviction == name          # reports name a policy by its function's name


def test_candidates_carry_ticks_hits_depth_and_the_prefix_tree():
    seen: list[list[EvictionCandidate]] = []

    def record(cands):
        seen.append(cands)
        return lru(cands)
    bm = BlockManager(6, 2, eviction=record)
    run(bm, "a", [1, 2, 3, 4, 5, 6, 7])          # blocks 0 1 2 (+ a partial one, freed)
    run(bm, "b", [1, 2, 3, 4, 9, 9, 9])          # hits 0 1; its own [9, 9] is block 4 (3 went back to the free list)
    run(bm, "c", [8, 8, 8, 8, 8, 8, 8])          # needs 4 blocks, 2 free: two evictions
    first = {c.block_id: c for c in seen[0]}
    assert set(first) == {0, 1, 2, 4}
    assert (first[0].depth, first[1].depth, first[2].depth, first[4].depth) == (0, 1, 2, 2)
    assert (first[0].parent, first[1].parent, first[2].parent, first[4].parent) == (None, 0, 1, 1)
    assert (first[0].children, first[1].children, first[2].children, first[4].children) == (1, 2, 0, 0)
    assert first[0].hits == first[1].hits == 1 and first[2].hits == first[4].hits == 0
    assert first[2].last_used < first[4].last_used < first[1].last_used < first[0].last_used   # tail first
    assert first[0].born < first[1].born < first[2].born < first[4].born
    # the second choice sees the pool without the first victim (2): block 1 lost a child
    second = {c.block_id: c for c in seen[1]}
    assert set(second) == {0, 1, 4} and second[1].children == 1
    assert bm.stats.evictions == 2


def test_a_prompts_hits_are_no_candidates_and_their_children_name_them():
    seen = []
    bm = BlockManager(7, 2, eviction=lambda c: seen.append(c) or lru(c))
    run(bm, "a", [1, 2, 3, 4, 5, 6, 7])                 # cached: 0 [1 2], 1 [3 4], 2 [5 6]
    run(bm, "x", [8, 8, 8, 8, 8])                       # cached: 4 [8 8], 5 [8 8]; free: 3 6
    bm.allocate("b", [1, 2, 3, 4, 9, 9, 9, 9, 9])       # hits 0 1, needs 3 more: 2 free, one eviction
    cands = {c.block_id: c for c in seen[0]}
    assert 0 not in cands and 1 not in cands, "a prompt's own hits are claimed before any eviction"
    assert cands[2].parent == 1 and bm.blocks[1].ref_count == 1     # the parent: held by b


@pytest.mark.parametrize("bad, match", [
    ("2", r"returned '2' \(str\): it must return the block_id \(an int\)"),
    (True, r"returned True \(bool\)"),
    (2.0, r"returned 2.0 \(float\)"),
    (None, r"returned None"),
    ("candidate", r"returned a candidate \(block \d+\): return its block_id"),
    (0, r"block 0 would be freed while a sequence still holds it"),       # b's hit, claimed
    (6, r"block 6 is free, not cached"),
    (99, r"there is no block 99 \(the pool has 7\)"),
])
def test_a_bad_choice_is_one_line_and_changes_nothing(bad, match):
    def policy(cands):
        return cands[0] if bad == "candidate" else bad
    bm = BlockManager(7, 2, eviction=policy)
    run(bm, "a", [1, 2, 3, 4, 5, 6, 7])
    run(bm, "x", [8, 8, 8, 8, 8])
    bm.allocate("hold", [1])                             # holds block 3: the free list is [6]
    before = snapshot(bm)
    with pytest.raises(WorkbenchError, match=match) as e:
        bm.allocate("b", [1, 2, 3, 4, 9, 9, 9, 9, 9])    # hits 0 1, needs 3: one free, two evictions
    assert "\n" not in str(e.value) and "eviction policy policy" in str(e.value)
    assert snapshot(bm) == before, "a refused choice must leave the manager as it was"
    bm.check_invariants()


def test_a_bad_second_choice_also_changes_nothing():
    calls = []

    def policy(cands):
        calls.append(len(cands))
        return lru(cands) if len(calls) == 1 else -1
    bm = BlockManager(6, 2, eviction=policy)
    run(bm, "a", [1, 2, 3, 4, 5, 6, 7])
    run(bm, "x", [8, 8, 8])
    before = snapshot(bm)
    with pytest.raises(WorkbenchError, match="there is no block -1"):
        bm.allocate("c", [5] * 11)
    assert calls == [4, 3] and snapshot(bm) == before


def test_a_policy_that_raises_changes_nothing():
    def policy(cands):
        raise KeyError("my bug")
    bm = BlockManager(4, 2, eviction=policy)
    run(bm, "a", [1, 2, 3, 4, 5])
    before = snapshot(bm)
    with pytest.raises(KeyError, match="my bug"):
        bm.allocate("b", [7] * 7)
    assert snapshot(bm) == before
    bm.check_invariants()


def test_append_and_restore_evict_through_the_policy():
    chosen = []
    bm = BlockManager(4, 2, eviction=lambda c: chosen.append(lru(c)) or chosen[-1])
    run(bm, "a", [1, 2, 3, 4])                           # cached 0 1
    run(bm, "b", [5, 6, 7], keep=True)                   # holds 2 3
    assert bm.append_slot("b", 8) is not None and not chosen
    assert bm.append_slot("b", 9) is not None and chosen == [1]     # a new block: a's tail goes first
    bm.check_invariants()
    bm.free("b")
    # restore_prefix brings evicted blocks back from a slower tier; its blocks come through the policy too
    bm2 = BlockManager(3, 2, eviction=lambda c: chosen.append(lru(c)) or chosen[-1])
    run(bm2, "x", [9, 9, 9, 9, 9])                       # cached: two [9 9] blocks; free: one
    restored = bm2.restore_prefix([1, 2, 3, 4, 5], holds=lambda h, toks: True)
    assert [t for _, _, t in restored] == [(1, 2), (3, 4)] and bm2.stats.evictions == 1
    bm2.check_invariants()


def test_slots_is_the_managers_slot_mapping():
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(10)))
    assert bm.slot_mapping("a", 2, 9) == slots(bm.block_table("a"), 2, 9, 4)
    assert slots([3, 7], 4, 5, 4) == [28] and slots([3], 2, 2, 4) == []
    with pytest.raises(WorkbenchError, match=r"\[0, 9\) is outside a block table of 2 blocks of 4 tokens"):
        slots([7, 2], 0, 9, 4)


def test_eviction_must_be_a_name_or_a_function():
    with pytest.raises(WorkbenchError, match="'lru', 'fifo' or a function choose_victim"):
        BlockManager(4, 4, eviction="random")
    from workbench.kv import PagedKVConfig
    assert PagedKVConfig(eviction=lru).eviction is lru
    with pytest.raises(ConfigError, match="'lru', 'fifo' or a function choose_victim"):
        PagedKVConfig(eviction="mru")


def test_a_policy_drives_a_live_engines_pool(random_llm):
    import workbench
    from workbench import SamplingParams
    from workbench.kv import PagedKVConfig

    calls = []

    def leaves_first(cands):
        calls.append(len(cands))
        leaves = [c for c in cands if c.children == 0]
        return min(leaves, key=lambda c: (c.hits, c.last_used)).block_id
    system = list(range(100, 124))
    prompts = [system + [7, 8, 9], list(range(200, 230)), system + [11, 12], list(range(300, 330)), system + [5]]
    outs = {}
    for policy in ("lru", leaves_first):
        llm = workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer, max_model_len=random_llm.max_model_len,
                            kv=PagedKVConfig(block_size=4, num_blocks=12, eviction=policy))
        greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
        outs[str(policy)] = [llm.generate([p], greedy)[0].token_ids for p in prompts]
        m = llm.kv_pool.manager
        m.check_invariants()
        assert m.stats.evictions > 0
    assert calls and m.eviction == "leaves_first"
    assert outs["lru"] == outs[str(leaves_first)], "the eviction policy must not change greedy tokens"

    def bad(cands):
        return "no"
    llm = workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer, max_model_len=random_llm.max_model_len,
                        kv=PagedKVConfig(block_size=4, num_blocks=12, eviction=bad))
    with pytest.raises(WorkbenchError, match=r"eviction policy bad returned 'no' \(str\)"):
        for p in prompts:
            llm.generate([p], greedy)
    llm.kv_pool.manager.check_invariants()
