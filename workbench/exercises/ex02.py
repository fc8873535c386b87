"""Notebook 02's exercises: the paged pool's bookkeeping (slot mapping, the prefix hash chain) and
an eviction policy that drives a live pool."""

from __future__ import annotations

import numbers

from workbench.exercises.core import Case, Exercise, show
from workbench.kv.block_manager import BlockManager, EvictionCandidate, lru, slots
from workbench.kv.prefix_cache import PrefixCache, block_hash


# ---- 02.slot_mapping -----------------------------------------------------------------------------
def _slot_cases() -> list[Case]:
    return [Case("one block, its four positions", dict(block_table=[5], start=0, end=4, block_size=4)),
            Case("a position on a block boundary: position 4 starts table block 1",
                 dict(block_table=[3, 7], start=4, end=5, block_size=4)),
            Case("a range across a block boundary", dict(block_table=[7, 2], start=2, end=6, block_size=4)),
            Case("start == end: no positions", dict(block_table=[3, 7], start=4, end=4, block_size=4)),
            Case("block size 1: every token is a block", dict(block_table=[4, 0, 9], start=0, end=3, block_size=1)),
            Case("a range spanning 3 blocks, the table out of order",
                 dict(block_table=[9, 3, 6], start=1, end=11, block_size=4)),
            Case("a decode step: one position inside the last block",
                 dict(block_table=[2, 8, 5], start=9, end=10, block_size=4))]


def _slot_strategy():
    from hypothesis import strategies as st

    @st.composite
    def kw(draw):
        B = draw(st.integers(1, 6))
        n = draw(st.integers(0, 5))
        table = draw(st.lists(st.integers(0, 31), min_size=n, max_size=n, unique=True))
        start = draw(st.integers(0, n * B))
        end = draw(st.integers(start, n * B))
        return dict(block_table=table, start=start, end=end, block_size=B)
    return kw()


def _slot_compare(kw: dict, got, expected) -> str | None:
    table, start, end, B = kw["block_table"], kw["start"], kw["end"], kw["block_size"]
    if not isinstance(got, (list, tuple)):
        return f"return a list of ints, one slot per position of [start, end); got {type(got).__name__} {show(got, 60)}"
    if len(got) != len(expected):
        if start == end:
            return f"start == end ({start}): the range [start, end) is empty, so there is no slot: return []"
        return (f"[{start}, {end}) holds end - start = {end - start} positions (end is excluded): one slot each, "
                f"got {len(got)} slots")
    for k, (g, e) in enumerate(zip(got, expected)):
        if isinstance(g, bool) or not isinstance(g, numbers.Integral):
            return f"item {k}: a slot is an int, got {type(g).__name__} {show(g, 40)}"
        if g == e:
            continue
        p = start + k
        j, o = divmod(p, B)
        blk = table[j]
        which = "the first token" if o == 0 else f"token {o}"
        msg = (f"item {k} (position {p}): expected slot {e}, got {g}\n"
               f"position {p} is {which} of table block {j} (physical block {blk}): slot {blk} * {B} + {o} = {e}")
        if g == p and p != e:
            msg += f"\n(you returned the position itself: the block table maps table block {j} to physical block {blk})"
        elif g == blk + o:
            msg += "\n(block id + offset: a block id counts blocks, a slot counts tokens: multiply it by block_size)"
        elif g == j * B + o + 1 or (k + 1 < len(expected) and g == expected[k + 1]):
            msg += "\n(that is the next position's slot: positions start at start, offsets at 0)"
        return msg
    return None


# ---- 02.block_hashes -----------------------------------------------------------------------------
class _Named:
    """A function shown by its name in a check's call line (``hash_block=block_hash``)."""

    def __init__(self, fn, name: str) -> None:
        self.fn, self.name = fn, name

    def __call__(self, *args):
        return self.fn(*args)

    def __repr__(self) -> str:
        return self.name


HASH_BLOCK = _Named(block_hash, "block_hash")


def _block_hashes(token_ids: list[int], block_size: int, hash_block) -> list[int]:
    return PrefixCache([], block_size, hash_fn=hash_block).chain(token_ids)


def _hash_cases() -> list[Case]:
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    b = [1, 2, 3, 4, 0, 0, 0, 0, 9, 10, 11, 12]
    return [Case("an empty prompt", dict(token_ids=[], block_size=4, hash_block=HASH_BLOCK)),
            Case("shorter than a block (3 tokens, blocks of 4)",
                 dict(token_ids=[7, 3, 9], block_size=4, hash_block=HASH_BLOCK)),
            Case("prompt A: 3 full blocks, an exact multiple (no partial tail)",
                 dict(token_ids=a, block_size=4, hash_block=HASH_BLOCK)),
            Case("prompt B: shares A's block 0, then diverges (its block 2 has A's block 2 tokens)",
                 dict(token_ids=b, block_size=4, hash_block=HASH_BLOCK)),
            Case("two full blocks and a partial tail of 3 tokens",
                 dict(token_ids=[7, 3, 9, 1, 4, 4, 2, 8, 6, 5, 0], block_size=4, hash_block=HASH_BLOCK)),
            Case("the same tokens twice in a row", dict(token_ids=[1, 2, 1, 2], block_size=2, hash_block=HASH_BLOCK)),
            Case("block size 1: every token is a block",
                 dict(token_ids=[5, 5, 6], block_size=1, hash_block=HASH_BLOCK))]


def _hash_strategy():
    from hypothesis import strategies as st

    return st.fixed_dictionaries({"token_ids": st.lists(st.integers(0, 3), max_size=16),
                                  "block_size": st.integers(1, 5), "hash_block": st.just(HASH_BLOCK)})


def _hash_compare(kw: dict, got, expected) -> str | None:
    toks, B, H = kw["token_ids"], kw["block_size"], kw["hash_block"]
    n = len(toks)
    full, tail = divmod(n, B)
    if not isinstance(got, (list, tuple)):
        return f"return a list of ints, one hash per full block; got {type(got).__name__} {show(got, 60)}"
    if len(got) != len(expected):
        if n == 0:
            return "an empty prompt has no block: return []"
        if len(got) > len(expected) and tail:
            return (f"the partial tail ({tail} token{'s' if tail > 1 else ''}) is never hashed: {n} tokens in blocks "
                    f"of {B} make {full} full block{'s' if full != 1 else ''}, so {full} "
                    f"hash{'es' if full != 1 else ''} (a block is reusable only when it is full)")
        if len(got) < len(expected) and not tail:
            return (f"{n} tokens are exactly {full} blocks of {B}: there is no partial tail, the last block is full "
                    f"and gets its hash too")
        return (f"one hash per FULL block: {n} tokens in blocks of {B} make n // block_size = {full}, "
                f"got {len(got)} hashes")
    for i, (g, e) in enumerate(zip(got, expected)):
        if isinstance(g, bool) or not isinstance(g, numbers.Integral):
            return f"item {i}: a hash is the int hash_block returns, got {type(g).__name__} {show(g, 40)}"
        if g == e:
            continue
        block = tuple(toks[i * B:(i + 1) * B])
        head = f"item {i}: expected {e}, got {g}"
        if i == 0:
            return f"{head}\nblock 0's hash is hash_block(None, token_ids[0:{B}]): the first block has no parent (None)"
        if g == H(None, block):
            return (f"{head}\nblock {i}'s hash must take block {i - 1}'s hash as its parent: hashed alone (parent "
                    f"None), block {i} {block} would get the same hash after any prefix, but its keys depend on every "
                    f"token before it")
        return (f"{head}\nblock {i}'s hash is hash_block(<block {i - 1}'s hash>, token_ids[{i * B}:{(i + 1) * B}]): "
                f"a chain, each block's hash taking the previous block's hash as its parent")
    return None


# ---- 02.eviction ---------------------------------------------------------------------------------
def _c(block_id, last_used, born, hits=0, depth=0, parent=None, children=0) -> EvictionCandidate:
    return EvictionCandidate(block_id, last_used, born, hits, depth, parent, children)


def _pool_snapshot() -> list[EvictionCandidate]:
    """The candidates a real pool offered: two prompt families, the third request evicting."""
    seen: list[list[EvictionCandidate]] = []

    def record(cands):
        seen.append(cands)
        return lru(cands)
    bm = BlockManager(6, 2, eviction=record)
    for i, p in enumerate(([1, 2, 3, 4, 5, 6, 7], [1, 2, 3, 4, 9, 9, 9], [8, 8, 8, 8, 8, 8, 8])):
        bm.allocate(f"r{i}", p)
        bm.commit(f"r{i}", len(p))
        bm.free(f"r{i}")
    return seen[0]


def _eviction_cases() -> list[Case]:
    return [Case("one cached block", dict(candidates=[_c(5, last_used=4, born=2)])),
            Case("block 3 is held by a running sequence (a prefix hit); its cached children 6 and 8",
                 dict(candidates=[_c(6, 5, 4, depth=1, parent=3), _c(8, 7, 6, depth=1, parent=3)])),
            Case("a chain of three cached blocks, 2 -> 7 -> 4 (block 2 is a prompt's first)",
                 dict(candidates=[_c(2, 9, 1, children=1), _c(7, 8, 2, depth=1, parent=2, children=1),
                                  _c(4, 7, 3, depth=2, parent=7)])),
            Case("two prompts share head block 1, then diverge: two leaves",
                 dict(candidates=[_c(1, 12, 1, hits=1, children=2), _c(5, 4, 2, depth=1, parent=1),
                                  _c(9, 11, 6, depth=1, parent=1)])),
            Case("an orphan: block 11's parent was evicted (parent None, depth 2)",
                 dict(candidates=[_c(11, 3, 2, depth=2), _c(0, 9, 5, hits=3, children=1),
                                  _c(6, 8, 6, hits=3, depth=1, parent=0)])),
            Case("head block 4 was evicted once and recomputed: fewer hits than its cached child 9",
                 dict(candidates=[_c(4, 20, 18, hits=0, children=1), _c(9, 10, 5, hits=2, depth=1, parent=4)])),
            Case("a real pool: two prompt families, the third request evicting", dict(candidates=_pool_snapshot()))]


def _eviction_strategy():
    from hypothesis import strategies as st

    @st.composite
    def kw(draw):
        B = draw(st.integers(1, 3))
        heads = draw(st.lists(st.lists(st.integers(0, 3), min_size=B, max_size=3 * B), min_size=1, max_size=3))
        reqs = draw(st.lists(st.tuples(st.integers(0, len(heads) - 1), st.lists(st.integers(0, 3), max_size=2 * B),
                                       st.booleans()), min_size=1, max_size=6))
        prompts = [heads[h] + tail for h, tail, _ in reqs]
        longest = max(-(-len(p) // B) for p in prompts)
        seen: list[list[EvictionCandidate]] = []

        def record(cands):
            seen.append(cands)
            return lru(cands)
        bm = BlockManager(2 * longest + draw(st.integers(0, 2)), B, eviction=record)
        running = None
        for i, (p, (_, _, overlap)) in enumerate(zip(prompts, reqs)):
            bm.allocate(f"r{i}", p)              # fits: at most one other sequence holds blocks
            bm.commit(f"r{i}", len(p))
            if running is not None:
                bm.free(running)
            running = f"r{i}"
            if not overlap:                      # else it still runs while the next one is admitted
                bm.free(running)
                running = None
        if running is not None:
            bm.free(running)
        cands = seen[draw(st.integers(0, len(seen) - 1))] if seen else bm.eviction_candidates()
        return {"candidates": cands}
    return kw()


def _eviction_rules(kw: dict, got) -> str | None:
    cands = kw["candidates"]
    ids = [c.block_id for c in cands]
    if isinstance(got, EvictionCandidate):
        return f"you returned a candidate (block {got.block_id}): return its block_id, an int"
    if isinstance(got, bool) or not isinstance(got, numbers.Integral):
        return f"choose_victim must return a block id, an int; got {type(got).__name__} {show(got, 60)}"
    got = int(got)
    if got not in ids:
        kids = [c.block_id for c in cands if c.parent == got]
        if kids:
            return (f"block {got} is freed while a sequence still holds it: it is the parent of cached block "
                    f"{kids[0]} but not a candidate, so a running sequence holds it (ref_count > 0); evict one of "
                    f"the candidates {ids} (ref_count 0)")
        return (f"block {got} is not a candidate: evict one of {ids} (the cached blocks, ref_count 0); a block "
                f"outside them is free or held by a sequence")
    c = cands[ids.index(got)]
    if c.children:
        kids = [k.block_id for k in cands if k.parent == got]
        leaves = [k.block_id for k in cands if not k.children]
        return (f"block {got} is evicted before its child, cached block {kids[0] if kids else '?'}: a leaf first "
                f"(children == 0; here {leaves}). The child continues {got}'s prefix and is reached only through it: "
                f"a tail without its head is never hit again, a head without its tail still is (BlockManager.free)")
    return None


EXERCISES = [
    Exercise(
        id="02.slot_mapping", notebook="02_kv_tiers", title="The slot mapping",
        teaches="how a paged pool turns a token position into a row of its KV tensors through the block table",
        statement=(
            "A sequence's KV lives in blocks of `block_size` tokens; its `block_table` lists their physical block "
            "ids in order. Return the physical slots (rows of a layer's cache viewed as `[num_blocks * block_size, "
            "...]`) of the token positions `start, start + 1, ..., end - 1`: where a prefill over `[start, end)` "
            "writes its keys and values."),
        hints=["Position `p` is in table block `p // block_size`, at offset `p % block_size` inside it.",
               "The table maps that table block to a physical block id; a slot counts tokens, so the physical "
               "block's first slot is `block_id * block_size`.",
               "`[block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]`"],
        stub=('def slot_mapping(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:\n'
              '    """Physical slots of token positions [start, end) of a sequence with this block table."""\n'
              '    # your code here\n'
              '    raise NotImplementedError'),
        reference=slots, cases=_slot_cases, strategy=_slot_strategy, compare=_slot_compare,
        plugs_into="section 2: your slots read the last request's keys back out of the live pool, checked "
                   "against the keys the model computes for its prompt"),
    Exercise(
        id="02.block_hashes", notebook="02_kv_tiers", title="The prefix hash chain",
        teaches="why a prefix cache hashes a block together with everything before it, and never a partial block",
        statement=(
            "Return the chain hash of every FULL block of `token_ids` (blocks of `block_size` tokens, in order): "
            "block `i`'s hash is `hash_block(parent, tokens)`, where `tokens` is the block's tuple of token ids and "
            "`parent` is block `i - 1`'s hash (`None` for block 0). A partial tail is not hashed. Equal hashes then "
            "mean equal *whole prefixes*, which is what a block's keys depend on."),
        hints=["There are `len(token_ids) // block_size` full blocks; the tokens after them (fewer than a block) "
               "never get a hash.",
               "Carry the previous hash along: start with `parent = None`, and after each block set `parent` to "
               "the hash you just computed.",
               "`for i in range(len(token_ids) // block_size): parent = hash_block(parent, tuple(token_ids[i * B:"
               "(i + 1) * B])); out.append(parent)`"],
        stub=('def block_hashes(token_ids: list[int], block_size: int, hash_block) -> list[int]:\n'
              '    """Chain hash of every full block: hash_block(previous block\'s hash or None, block tokens)."""\n'
              '    # your code here\n'
              '    raise NotImplementedError'),
        reference=_block_hashes, cases=_hash_cases, strategy=_hash_strategy, compare=_hash_compare,
        plugs_into="section 2: your hashes predict how many prompt tokens each request reused, beside what the "
                   "engine's inspector measured"),
    Exercise(
        id="02.eviction", notebook="02_kv_tiers", title="An eviction policy",
        teaches="what an eviction policy may and may not take from a prefix cache, and how its choice moves the "
                "hit rate",
        statement=(
            "When a request needs a block and the free list is empty, the block manager evicts a *cached* block "
            "(ref_count 0). `candidates` lists every cached block as an `EvictionCandidate`: `block_id`; "
            "`last_used` (when its last user let go) and `born` (when its KV was committed), ticks of one clock, "
            "larger is later; `hits` (how many later prompts reused it); `depth` (0: a prompt's first block); "
            "`parent` (the block holding the previous block of its prefix; `None` for a first block or when that "
            "block was evicted) and `children` (cached blocks that continue it). Return the `block_id` to evict. "
            "The rules: only a candidate (never a block a sequence still holds), and a leaf before its parent "
            "(never a candidate with `children > 0`: a tail is reached only through its head). Beyond that the "
            "choice is yours: in section 4 your policy runs a live pool, beside LRU and FIFO."),
        hints=["Keep only the leaves, `c.children == 0`: there is always one (a prefix tree has leaves). Then pick "
               "among them by whatever you think predicts that a block will not be reused.",
               "LRU among the leaves is `min(leaves, key=lambda c: c.last_used)`. A block that was hit before "
               "(`hits > 0`) belongs to a prefix that prompts share; long one-off prompts never are. Keeping the "
               "first over the second beats LRU when one-off prompts pass through between shared ones.",
               "`leaves = [c for c in candidates if c.children == 0]` then "
               "`return min(leaves, key=lambda c: (c.hits, c.last_used)).block_id`: the fewest hits first, the "
               "least recently used among equals."],
        stub=('from workbench.kv.block_manager import EvictionCandidate\n\n\n'
              'def choose_victim(candidates: list[EvictionCandidate]) -> int:\n'
              '    """The block_id of the cached block to evict now (candidates: every cached block, ref_count 0)."""\n'
              '    # your code here\n'
              '    raise NotImplementedError'),
        reference=lru, cases=_eviction_cases, strategy=_eviction_strategy, rules=_eviction_rules,
        plugs_into="section 4: PagedKVConfig(eviction=choose_victim) runs a live engine's pool on a shared-prefix "
                   "workload with one-off prompts between; its hit rate beside LRU's and FIFO's, and its block-map "
                   "replay"),
]
