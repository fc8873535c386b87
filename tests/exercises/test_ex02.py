"""Notebook 02's exercises (``workbench.exercises.ex02``): the solutions and the references pass,
planted mistakes are rejected with the case and the rule named.  The hook the eviction policy
plugs into (``BlockManager(eviction=<function>)``, ``PagedKVConfig(eviction=...)``) is tested in
tests/kv/test_eviction_policy.py and by the state machine of tests/kv/test_block_manager.py."""

from __future__ import annotations

import math

import pytest

from workbench.exercises import check_fn, get, load_solution
from workbench.kv.block_manager import BlockManager, EvictionCandidate, fifo, lru
from workbench.kv.prefix_cache import PrefixCache


def rejected(eid: str, fn, case: str, *rule: str):
    r = check_fn(get(eid), fn)
    assert r.status == "failed", r
    assert case in r.case, r
    for part in rule:
        assert part in r.rule, r
    return r


@pytest.mark.parametrize("eid", ["02.slot_mapping", "02.block_hashes", "02.eviction"])
def test_solution_and_reference_pass(eid):
    ex = get(eid)
    for fn in (load_solution(eid), ex.reference):
        r = check_fn(ex, fn)
        assert r.passed, r
        assert r.cases_run == len(ex.cases()) and r.examples_run == ex.examples


def test_the_references_are_the_packages_own():
    bm = BlockManager(8, 4)
    bm.allocate("a", list(range(10)))
    table = bm.block_table("a")
    assert get("02.slot_mapping").reference(table, 3, 10, 4) == bm.slot_mapping("a", 3, 10)
    toks = [7, 3, 9, 1, 4, 4, 2, 8, 6]
    assert get("02.block_hashes").reference(toks, 4, bm.prefix_cache.hash) == PrefixCache([], 4).chain(toks)
    assert get("02.eviction").reference is not None
    cands = [EvictionCandidate(1, 5, 1, 0, 0, None, 0), EvictionCandidate(2, 3, 2, 0, 0, None, 0)]
    assert get("02.eviction").reference(cands) == lru(cands) == 2


# ---- 02.slot_mapping ----------------------------------------------------------------------------------
def slots_one_short(block_table, start, end, block_size):          # off by one: end - 1 excluded too
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end - 1)]


def slots_offset_plus_one(block_table, start, end, block_size):    # off by one: offsets from 1
    return [block_table[p // block_size] * block_size + p % block_size + 1 for p in range(start, end)]


def slots_no_multiply(block_table, start, end, block_size):
    return [block_table[p // block_size] + p % block_size for p in range(start, end)]


def slots_positions(block_table, start, end, block_size):         # no block table at all
    return list(range(start, end))


def slots_relative(block_table, start, end, block_size):          # table block counted from start
    return [block_table[(p - start) // block_size] * block_size + p % block_size for p in range(start, end)]


def slots_tensor(block_table, start, end, block_size):            # a tensor, not a list
    import torch
    return torch.tensor([block_table[p // block_size] * block_size + p % block_size for p in range(start, end)])


def slots_never_empty(block_table, start, end, block_size):       # missed edge case: start == end
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, max(end, start + 1))]


def test_slot_mapping_mistakes_name_the_case_and_the_rule():
    rejected("02.slot_mapping", slots_one_short, "one block", "[0, 4) holds end - start = 4 positions",
             "end is excluded")
    rejected("02.slot_mapping", slots_offset_plus_one, "one block", "position 0 is the first token of table block 0",
             "slot 5 * 4 + 0 = 20", "next position's slot")
    rejected("02.slot_mapping", slots_no_multiply, "one block", "multiply it by block_size")
    rejected("02.slot_mapping", slots_positions, "one block", "you returned the position itself")
    r = rejected("02.slot_mapping", slots_relative, "a position on a block boundary",
                 "position 4 is the first token of table block 1 (physical block 7): slot 7 * 4 + 0 = 28")
    assert r.expected == "[28]" and r.got == "[12]"
    rejected("02.slot_mapping", slots_tensor, "one block", "return a list of ints", "got Tensor")
    rejected("02.slot_mapping", slots_never_empty, "start == end", "the range [start, end) is empty", "return []")


# ---- 02.block_hashes ----------------------------------------------------------------------------------
def hashes_with_tail(token_ids, block_size, hash_block):            # hashes the partial tail too
    out, parent = [], None
    for i in range(math.ceil(len(token_ids) / block_size)):
        parent = hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


def hashes_without_parent(token_ids, block_size, hash_block):       # no chain
    return [hash_block(None, tuple(token_ids[i * block_size:(i + 1) * block_size]))
            for i in range(len(token_ids) // block_size)]


def hashes_one_short(token_ids, block_size, hash_block):            # off by one: (n - 1) // B blocks
    out, parent = [], None
    for i in range((len(token_ids) - 1) // block_size):
        parent = hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(parent)
    return out


def hashes_as_hex(token_ids, block_size, hash_block):               # wrong type: strings
    return [hex(h) for h in hashes_without_parent(token_ids, block_size, hash_block)]


def hashes_first_block_always(token_ids, block_size, hash_block):   # missed edge case: an empty prompt
    out = [hash_block(None, tuple(token_ids[:block_size]))]
    for i in range(1, len(token_ids) // block_size):
        out.append(hash_block(out[-1], tuple(token_ids[i * block_size:(i + 1) * block_size])))
    return out


def test_block_hashes_mistakes_name_the_case_and_the_rule():
    rejected("02.block_hashes", hashes_with_tail, "shorter than a block", "the partial tail (3 tokens) is never hashed")
    rejected("02.block_hashes", hashes_without_parent, "prompt A",
             "block 1's hash must take block 0's hash as its parent")
    rejected("02.block_hashes", hashes_one_short, "an exact multiple",
             "12 tokens are exactly 3 blocks of 4: there is no partial tail")
    rejected("02.block_hashes", hashes_as_hex, "prompt A",
             "a hash is the int hash_block returns, got str")
    rejected("02.block_hashes", hashes_first_block_always, "an empty prompt", "an empty prompt has no block: return []")


def test_a_chain_with_the_wrong_parent_is_named():
    def grandparent_chain(token_ids, block_size, hash_block):      # block i takes block i - 2's hash
        out = []
        for i in range(len(token_ids) // block_size):
            parent = out[i - 2] if i >= 2 else (out[-1] if out else None)
            out.append(hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size])))
        return out
    rejected("02.block_hashes", grandparent_chain, "prompt A",
             "block 2's hash is hash_block(<block 1's hash>, token_ids[8:12])")


# ---- 02.eviction --------------------------------------------------------------------------------------
def victim_fifo(candidates):                       # the head of a chain: a parent before its children
    return fifo(candidates)


def victim_candidate(candidates):                  # wrong type: the candidate, not its id
    return min(candidates, key=lambda c: c.last_used)


def victim_index(candidates):                      # off: the index in the list, not the block id
    return candidates.index(min(candidates, key=lambda c: c.last_used))


def victim_parent(candidates):                     # the block a sequence still holds
    c = min(candidates, key=lambda c: c.last_used)
    return c.parent if c.parent is not None else c.block_id


def victim_fewest_hits(candidates):                # missed edge case: a recomputed head has fewer hits
    return min(candidates, key=lambda c: (c.hits, c.last_used)).block_id


def victim_most_recent(candidates):                # MRU without the leaf rule
    return max(candidates, key=lambda c: c.last_used).block_id


def test_eviction_mistakes_name_the_case_and_the_rule():
    rejected("02.eviction", victim_fifo, "a chain of three cached blocks",
             "block 2 is evicted before its child, cached block 7: a leaf first", "(BlockManager.free)")
    rejected("02.eviction", victim_candidate, "one cached block", "you returned a candidate (block 5)",
             "return its block_id")
    rejected("02.eviction", victim_index, "one cached block", "block 0 is not a candidate: evict one of [5]")
    rejected("02.eviction", victim_parent, "block 3 is held", "block 3 is freed while a sequence still holds it",
             "evict one of the candidates [6, 8]")
    rejected("02.eviction", victim_fewest_hits, "recomputed", "block 4 is evicted before its child, cached block 9")
    rejected("02.eviction", victim_most_recent, "a chain of three", "a leaf first (children == 0; here [4])")
    rejected("02.eviction", lambda candidates: "4", "one cached block", "must return a block id, an int; got str")


def test_any_leaf_is_a_valid_choice():
    """The answer is not unique: the rules accept every leaf, whatever order picks it."""
    def newest_leaf(candidates):
        return max((c for c in candidates if c.children == 0), key=lambda c: c.last_used).block_id

    def deepest_leaf(candidates):
        return max((c for c in candidates if c.children == 0), key=lambda c: (c.depth, c.block_id)).block_id
    for fn in (newest_leaf, deepest_leaf):
        assert check_fn(get("02.eviction"), fn).passed


def test_the_checks_are_fast_enough_for_a_notebook():
    import time
    for eid in ("02.slot_mapping", "02.block_hashes", "02.eviction"):
        t0 = time.perf_counter()
        check_fn(get(eid), load_solution(eid))
        assert time.perf_counter() - t0 < 5, eid
