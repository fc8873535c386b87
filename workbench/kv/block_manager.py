"""Paged-KV bookkeeping: which physical block holds which tokens of which sequence.

Pure Python, no tensors: the paged pool (``workbench.kv.paged``) owns the KV tensors
``[num_blocks, block_size, ...]`` and asks this class where to write.  Token ``p`` of a sequence
lives at *slot* ``block_table[p // B] * B + p % B``.  ::

    bm = BlockManager(num_blocks=8, block_size=4)
    a = bm.allocate("r1", prompt)            # block table for the prompt; a.num_cached_tokens reused
    bm.slot_mapping("r1", a.num_cached_tokens, len(prompt))   # where the prefill writes its KV
    bm.commit("r1", len(prompt))             # KV written: full blocks become reusable by others
    bm.append_slot("r1", next_token)         # slot for the next token (new block / copy-on-write)
    bm.take_copies()                         # [(src, dst)] block copies to perform before writing
    bm.free("r1")                            # refs drop; committed full blocks stay *cached*

Every physical block is in exactly one state:

==========  =========  ============================================================
state       ref_count  meaning
==========  =========  ============================================================
free        0          no content, in the free list
owned       1          used by one sequence
shared      > 1        used by several (prefix hits, fork)
cached      0          no user, but holds a committed full block that a later request
                       can reuse; evicted (LRU or FIFO) only when the free list is empty
==========  =========  ============================================================

Eviction: ``eviction="lru"`` (the block whose last user let go longest ago) or ``"fifo"`` (the
oldest commit), kept in a heap; or a function ``choose_victim(candidates) -> block_id`` that gets
every cached block as an :class:`EvictionCandidate` (ticks, hits, depth, parent, children) each
time one must go, and returns the id of one of them (:func:`lru` and :func:`fifo` are the two
orders written as such functions).  A return that is not a candidate's id is a WorkbenchError,
raised before anything changes.

A block becomes reusable only after :meth:`commit` says its KV exists — never at allocation,
or a second request could read keys that no one has written yet.  Hits, hashing and miss
reasons live in :mod:`workbench.kv.prefix_cache`.

Contract for copy-on-write: :meth:`take_copies` must be called (and the copies done) after each
:meth:`append_slot` / :meth:`allocate`, before any :meth:`free` could hand the source block out.

Over 400 lines because :class:`BlockManager` is one state machine (free list, eviction heap or
policy, tables, prefix index) whose every method, ``check_invariants`` included, keeps the same private
state consistent; split, that state would be read across modules.
"""

from __future__ import annotations

import heapq
import numbers
from collections import Counter, deque
from collections.abc import Callable, Sequence

from workbench.errors import WorkbenchError
from workbench.kv.blocks import AllocStatus, Allocation, Block, EvictionCandidate, KVStats, _as_token_ids, _Seq
from workbench.kv.interface import PrefixMatch
from workbench.kv.prefix_cache import MissReason, PrefixCache

__all__ = ["AllocStatus", "Allocation", "Block", "BlockManager", "EvictionCandidate", "EvictionPolicy", "KVStats",
           "MissReason", "fifo", "lru", "slots"]

#: ``choose_victim(candidates) -> block_id``: which cached block to evict (module doc)
EvictionPolicy = Callable[[list[EvictionCandidate]], int]


def lru(candidates: list[EvictionCandidate]) -> int:
    """The least recently used candidate: the one whose last user let go longest ago (what
    ``eviction="lru"`` evicts)."""
    return min(candidates, key=lambda c: c.last_used).block_id


def fifo(candidates: list[EvictionCandidate]) -> int:
    """The candidate committed first (what ``eviction="fifo"`` evicts)."""
    return min(candidates, key=lambda c: c.born).block_id


def slots(block_table: Sequence[int], start: int, end: int, block_size: int) -> list[int]:
    """Physical slots of token positions [start, end) of a sequence with this block table:
    position ``p`` is token ``p % block_size`` of table block ``p // block_size``, so its slot is
    ``block_table[p // block_size] * block_size + p % block_size``."""
    B = block_size
    if not 0 <= start <= end <= len(block_table) * B:
        raise WorkbenchError(f"slot mapping: [{start}, {end}) is outside a block table of {len(block_table)} blocks "
                             f"of {B} tokens")
    return [block_table[p // B] * B + p % B for p in range(start, end)]


class BlockManager:
    """The bookkeeping of a pool of KV blocks (module doc).  It is a
    :class:`~workbench.kv.interface.KVManager`: a scheduler can drive it directly."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 eviction: str | EvictionPolicy = "lru") -> None:
        for name, v in (("num_blocks", num_blocks), ("block_size", block_size)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise WorkbenchError(f"BlockManager: {name} must be a positive integer, got {v!r}")
        if callable(eviction):     # a policy: the reports name it by its function's name
            self._policy: EvictionPolicy | None = eviction
            eviction = getattr(eviction, "__name__", type(eviction).__name__)
        elif eviction in ("lru", "fifo"):
            self._policy = None
        else:
            raise WorkbenchError(f"BlockManager: eviction must be 'lru', 'fifo' or a function "
                                 f"choose_victim(candidates) -> block id, got {eviction!r}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching, self.eviction = bool(enable_prefix_caching), eviction
        self.blocks = [Block(i) for i in range(num_blocks)]
        # miss-reason memory: a few prefixes per block of the pool, bounded (module doc of prefix_cache)
        self.prefix_cache = PrefixCache(self.blocks, block_size, history=min(max(4096, 4 * num_blocks), 65536))
        self._free: deque[int] = deque(range(num_blocks))
        # cached blocks: id -> eviction priority (smallest goes first); heap with lazy deletion
        self._evictable: dict[int, int] = {}
        self._heap: list[tuple[int, int]] = []
        self._seqs: dict[str, _Seq] = {}
        self._copies: list[tuple[int, int]] = []
        self._tick = 0
        self.stats = KVStats()
        # Called as on_evict(block_id, hash, tokens) just before a cached block is reused, while
        # its KV is still intact: the paged pool spills it to the offload tier here.
        self.on_evict = None

    # ---- counts -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_available_blocks(self) -> int:
        """Blocks a request can get now: free plus evictable cached."""
        return len(self._free) + len(self._evictable)

    def seq_ids(self) -> list[str]:
        """Ids of the sequences holding blocks now."""
        return list(self._seqs)

    def __contains__(self, seq_id: str) -> bool:
        return seq_id in self._seqs

    def _seq(self, seq_id: str) -> _Seq:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise WorkbenchError(f"BlockManager: unknown sequence {seq_id!r} (never allocated, or freed)") from None

    def num_tokens(self, seq_id: str) -> int:
        return len(self._seq(seq_id).tokens)

    def num_committed(self, seq_id: str) -> int:
        return self._seq(seq_id).committed

    # ---- admission ----------------------------------------------------------------------------
    def _blocks_for(self, n: int) -> int:
        return -(-n // self.block_size)

    def _match(self, token_ids: list[int], reuse: bool = True) -> tuple[list[int], list[int], MissReason | None]:
        """Reusable blocks for a prompt (no state change): (hit block ids, hashes of its full
        blocks, miss reason).  ``reuse=False``: none (the request computes its whole prompt)."""
        if not self.enable_prefix_caching:
            return [], [], MissReason.DISABLED
        if not reuse:
            return [], self.prefix_cache.chain(token_ids), MissReason.FULL_PROMPT
        B, pc = self.block_size, self.prefix_cache
        hashes = pc.chain(token_ids)
        max_hit = (len(token_ids) - 1) // B  # the final token is always computed
        hits: list[int] = []
        parent_cid = None
        for i in range(max_hit):
            bid = pc.lookup(hashes[i], tuple(token_ids[i * B:(i + 1) * B]), parent_cid)
            if bid is None:
                break
            hits.append(bid)
            parent_cid = self.blocks[bid].cid
        i = len(hits)
        if max_hit == 0:  # nothing reusable: did an earlier prompt share the tokens before the last?
            reason = pc.miss_reason(None, None, token_ids[:len(token_ids) - 1])
        elif i == max_hit:
            reason = None
        else:
            reason = pc.miss_reason(hashes[i - 1] if i else None, hashes[i], token_ids[i * B:(i + 1) * B])
        return hits, hashes, reason

    def match_prefix(self, token_ids: list[int], reuse: bool = True) -> PrefixMatch:
        """The cached prefix blocks :meth:`allocate` would reuse for this prompt now (no state
        change), and how many of them no sequence holds; ``reuse=False``: none."""
        hits = self._match(list(token_ids), reuse)[0]
        return PrefixMatch(tuple(hits), len(hits) * self.block_size,
                           sum(1 for b in hits if self.blocks[b].ref_count == 0))

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Prompt tokens :meth:`allocate` would reuse now (no state change): for prefix-aware
        ordering of waiting requests."""
        return len(self._match(list(token_ids))[0]) * self.block_size

    def block_refs(self, block_id: int) -> int:
        """How many sequences hold block ``block_id`` now (0: free or cached)."""
        return self.blocks[block_id].ref_count

    def can_allocate(self, num_tokens: int, token_ids: list[int] | None = None, reuse: bool = True) -> AllocStatus:
        """Would a prompt of ``num_tokens`` tokens fit? Pass ``token_ids`` (the prompt) to count
        prefix-cache hits, which need no new block; :meth:`allocate` agrees exactly."""
        need = self._blocks_for(num_tokens)
        if need > self.num_blocks:
            return AllocStatus.NEVER
        hits = self._match(list(token_ids), reuse)[0] if token_ids else []
        return AllocStatus.OK if self._fits(need, hits) else AllocStatus.LATER

    def _fits(self, need: int, hits: list[int]) -> bool:
        cached_hits = sum(1 for b in hits if self.blocks[b].ref_count == 0)  # no longer evictable
        return need - len(hits) <= self.num_available_blocks - cached_hits

    def allocate(self, seq_id: str, token_ids: list[int], reuse: bool = True) -> Allocation | None:
        """Blocks for a new sequence's prompt, reusing committed cached prefix blocks (not with
        ``reuse=False``: its blocks are its own, computed in full, and cached for later ones).
        None when the blocks cannot be had now (state unchanged; see :meth:`can_allocate`)."""
        if seq_id in self._seqs:
            raise WorkbenchError(f"BlockManager.allocate: sequence {seq_id!r} is already allocated")
        token_ids = _as_token_ids(token_ids, f"BlockManager.allocate({seq_id!r})")
        if not token_ids:
            raise WorkbenchError(f"BlockManager.allocate: sequence {seq_id!r} has an empty prompt")
        n, B = len(token_ids), self.block_size
        need = self._blocks_for(n)
        if need > self.num_blocks:
            return None
        hits, hashes, reason = self._match(token_ids, reuse)
        if not self._fits(need, hits):
            return None
        # a policy chooses every victim before anything changes: a bad choice leaves no trace
        victims = self._choose_victims(need - len(hits) - len(self._free), set(hits)) if self._policy else []
        for bid in hits:  # claim hits first, so the evictions below cannot take them
            self._ref(bid)
            self.blocks[bid].hits += 1
        table = list(hits)
        for j in range(len(hits), need):
            bid = self._take_block(victims)
            if j < len(hashes):  # a full prompt block this request will compute
                self.blocks[bid].pending_hash = hashes[j]
                self.prefix_cache.pending[hashes[j]] += 1
            table.append(bid)
        if self.enable_prefix_caching:  # remember every prompt block (and tail) for miss reasons
            for j in range(need):
                self.prefix_cache.remember(hashes[j - 1] if j else None, tuple(token_ids[j * B:(j + 1) * B]))
        self._seqs[seq_id] = _Seq(token_ids, table, len(hits) * B)
        alloc = Allocation(seq_id, list(table), len(hits) * B, n, reason, ((n - 1) // B) * B)
        self.stats.record(alloc)
        return alloc

    def restore_prefix(self, token_ids: list[int], holds) -> list[tuple[int, int, tuple]]:
        """Bring evicted prefix blocks back from a slower tier before :meth:`allocate`.

        Walks the prompt's chain past the blocks the pool still caches; while
        ``holds(hash, tokens)`` says another tier has the next block, takes a block for it and
        registers it as cached content.  Returns ``[(block_id, hash, tokens)]``: the caller must
        copy each block's KV in before anything else runs; :meth:`allocate` then hits them.
        """
        if not self.enable_prefix_caching:
            return []
        token_ids = _as_token_ids(token_ids, "BlockManager.restore_prefix")
        hits, hashes, _ = self._match(token_ids)
        B, pc = self.block_size, self.prefix_cache
        held, restored = list(hits), []
        for bid in held:            # keep the matched chain out of the evictions below
            self._ref(bid)
        try:
            for i in range(len(hits), (len(token_ids) - 1) // B):
                tokens = tuple(token_ids[i * B:(i + 1) * B])
                if hashes[i] in pc.index or self.num_available_blocks == 0 or not holds(hashes[i], tokens):
                    break
                b = self.blocks[self._take_block()]
                parent = self.blocks[held[-1]] if held else None
                self._tick += 1
                b.hash, b.tokens, b.born, b.depth = hashes[i], tokens, self._tick, i
                b.parent_cid = parent.cid if parent else None
                b.cid = pc.content_id(hashes[i], tokens, b.parent_cid)
                pc.register(hashes[i], b.id)
                held.append(b.id)
                restored.append((b.id, hashes[i], tokens))
        finally:
            for bid in reversed(held):
                b = self.blocks[bid]
                b.ref_count -= 1
                if b.ref_count == 0:
                    self._release(b)
        self.stats.restored_blocks += len(restored)
        return restored

    # ---- growth -------------------------------------------------------------------------------
    def _needs_block(self, s: _Seq) -> bool:
        return len(s.tokens) % self.block_size == 0 or self.blocks[s.table[-1]].ref_count > 1

    def can_append(self, seq_id: str) -> bool:
        """Would :meth:`append_slot` succeed now?"""
        return not self._needs_block(self._seq(seq_id)) or self.num_available_blocks > 0

    def append_slot(self, seq_id: str, token_id: int) -> int | None:
        """Reserve the slot of position ``len(tokens)`` for ``token_id``; returns the slot, or None
        (state unchanged) when a new block is needed and none can be had."""
        s = self._seq(seq_id)
        token_id = _as_token_ids([token_id], f"BlockManager.append_slot({seq_id!r})")[0]
        pos, B = len(s.tokens), self.block_size
        if self._needs_block(s):
            if self.num_available_blocks == 0:
                return None
            new = self._take_block()
            if pos % B == 0:            # last block full (or no block yet): open a new one
                s.table.append(new)
            else:                        # last block shared (fork): copy-on-write
                src = s.table[-1]
                self.blocks[src].ref_count -= 1   # stays >= 1: others still use it
                s.table[-1] = new
                self._copies.append((src, new))
                self.stats.cow_copies += 1
        s.tokens.append(token_id)
        return s.table[-1] * B + pos % B

    def take_copies(self) -> list[tuple[int, int]]:
        """Pending (src_block, dst_block) copies from copy-on-write; the caller performs them."""
        out, self._copies = self._copies, []
        return out

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent (beam search, parallel sampling)."""
        p = self._seq(parent_id)
        if child_id in self._seqs:
            raise WorkbenchError(f"BlockManager.fork: sequence {child_id!r} is already allocated")
        for bid in p.table:
            self.blocks[bid].ref_count += 1
        self._seqs[child_id] = _Seq(list(p.tokens), list(p.table), p.committed)

    def commit(self, seq_id: str, num_tokens_computed: int) -> None:
        """The KV of the first ``num_tokens_computed`` tokens is written: full blocks among them
        get their content registered, so later requests can reuse them."""
        s, B = self._seq(seq_id), self.block_size
        if not 0 <= num_tokens_computed <= len(s.tokens):
            raise WorkbenchError(f"BlockManager.commit: sequence {seq_id!r} has {len(s.tokens)} tokens with "
                                 f"slots, cannot commit {num_tokens_computed}")
        if num_tokens_computed <= s.committed:
            return
        first, last = s.committed // B, num_tokens_computed // B
        s.committed = num_tokens_computed
        if self.enable_prefix_caching:
            for j in range(first, last):
                self._register(s, j)

    def _register(self, s: _Seq, j: int) -> None:
        b, B, pc = self.blocks[s.table[j]], self.block_size, self.prefix_cache
        if b.cid is not None:  # already registered (a hit, or shared with a sequence that committed)
            return
        parent = self.blocks[s.table[j - 1]] if j else None
        parent_hash = parent.hash if parent else None
        parent_cid = parent.cid if parent else None
        tokens = tuple(s.tokens[j * B:(j + 1) * B])
        h = pc.hash(parent_hash, tokens)
        if b.pending_hash is not None:
            pc.pending[b.pending_hash] -= 1
            if not pc.pending[b.pending_hash]:
                del pc.pending[b.pending_hash]
        self._tick += 1
        b.hash, b.tokens, b.parent_cid, b.born, b.pending_hash, b.depth = h, tokens, parent_cid, self._tick, None, j
        b.cid = pc.content_id(h, tokens, parent_cid)
        pc.register(h, b.id)
        pc.remember(parent_hash, tokens)

    # ---- release ------------------------------------------------------------------------------
    def free(self, seq_id: str) -> None:
        """Drop the sequence. Its blocks lose a reference, last block first, so that under LRU
        the tail of a prefix is evicted before its head (a head without its tail is still useful,
        a tail without its head is not)."""
        s = self._seq(seq_id)
        del self._seqs[seq_id]
        for bid in reversed(s.table):
            b = self.blocks[bid]
            b.ref_count -= 1
            if b.ref_count == 0:
                self._release(b)

    def _release(self, b: Block) -> None:
        if b.cid is not None and self.prefix_cache.index.get(b.hash) == b.id:
            self._tick += 1
            b.last_used = self._tick
            prio = self._tick if self._policy is not None or self.eviction == "lru" else b.born
            self._evictable[b.id] = prio
            heapq.heappush(self._heap, (prio, b.id))
            return
        if b.pending_hash is not None:  # its request ended before computing it
            pc = self.prefix_cache
            pc.pending[b.pending_hash] -= 1
            if not pc.pending[b.pending_hash]:
                del pc.pending[b.pending_hash]
        b.reset()
        self._free.append(b.id)

    def _ref(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref_count == 0:
            del self._evictable[bid]  # its heap entry goes stale
        b.ref_count += 1

    def _take_block(self, victims: list[int] | None = None) -> int:
        """A block with no content and ref_count 1: from the free list, else evict a cached one
        (the next of ``victims`` when a policy chose them ahead, else its choice now, else the heap's)."""
        if self._free:
            bid = self._free.popleft()
        else:
            if self._policy is not None:
                bid = victims.pop(0) if victims else self._choose_victims(1)[0]
            else:
                while True:
                    prio, bid = heapq.heappop(self._heap)
                    if self._evictable.get(bid) == prio:
                        break
            del self._evictable[bid]   # (a policy's victim leaves a stale heap entry: skipped lazily)
            b = self.blocks[bid]
            if self.on_evict is not None:
                self.on_evict(bid, b.hash, b.tokens)
            self.prefix_cache.on_evict(b.hash, b.tokens, b.parent_cid, b.cid)
            b.reset()
            self.stats.evictions += 1
        if len(self._heap) > 2 * len(self._evictable) + 64:  # drop stale entries now and then
            self._heap = [(p, i) for i, p in self._evictable.items()]
            heapq.heapify(self._heap)
        self.blocks[bid].ref_count = 1
        return bid

    # ---- eviction by a policy -----------------------------------------------------------------
    def eviction_candidates(self, claimed: set[int] = frozenset(), gone: set[int] = frozenset()
                            ) -> list[EvictionCandidate]:
        """Every cached block as a policy sees it (oldest release first).  ``claimed``: cached
        blocks about to be held (a prompt's hits), ``gone``: blocks already chosen to be evicted."""
        owner: dict[int, int] = {}   # cid -> the block in the pool holding that prefix (the indexed one first)
        index = self.prefix_cache.index
        for indexed in (False, True):
            for b in self.blocks:
                if b.cid is not None and b.id not in gone and (index.get(b.hash) == b.id) == indexed \
                        and (b.ref_count > 0 or b.id in self._evictable):
                    owner[b.cid] = b.id
        cached = sorted((bid for bid in self._evictable if bid not in claimed and bid not in gone),
                        key=lambda i: self.blocks[i].last_used)
        parents = {bid: owner.get(self.blocks[bid].parent_cid) if self.blocks[bid].parent_cid is not None else None
                   for bid in cached}
        children = Counter(p for p in parents.values() if p in parents)
        return [EvictionCandidate(bid, b.last_used, b.born, b.hits, b.depth, parents[bid], children[bid])
                for bid, b in ((i, self.blocks[i]) for i in cached)]

    def _choose_victims(self, n: int, claimed: set[int] = frozenset()) -> list[int]:
        """Ask the policy for ``n`` victims, one at a time (each choice sees the pool without the
        ones before it); every answer is checked before anything changes."""
        victims: list[int] = []
        for _ in range(max(n, 0)):
            cands = self.eviction_candidates(claimed, set(victims))
            got = self._policy(cands)
            victims.append(self._check_victim(got, cands, claimed, victims))
        return victims

    def _check_victim(self, got, cands: list[EvictionCandidate], claimed=(), chosen=()) -> int:
        ids = [c.block_id for c in cands]
        shown = ", ".join(map(str, ids[:12])) + (", ..." if len(ids) > 12 else "")
        where = f"BlockManager: the eviction policy {self.eviction} "
        if isinstance(got, EvictionCandidate):
            raise WorkbenchError(where + f"returned a candidate (block {got.block_id}): return its block_id, an int")
        if isinstance(got, bool) or not isinstance(got, numbers.Integral):
            shown_got = repr(got) if len(repr(got)) <= 60 else repr(got)[:57] + "..."
            raise WorkbenchError(where + f"returned {shown_got} ({type(got).__name__}): it must return the block_id "
                                 f"(an int) of one of its {len(ids)} candidates [{shown}]")
        got = int(got)
        if got not in ids:
            held = 0 <= got < self.num_blocks and (self.blocks[got].ref_count > 0 or got in claimed)
            why = (f"there is no block {got} (the pool has {self.num_blocks})" if not 0 <= got < self.num_blocks else
                   f"block {got} would be freed while a sequence still holds it (" +
                   (f"ref_count {self.blocks[got].ref_count})" if self.blocks[got].ref_count else
                    "a prefix hit of the prompt being admitted)") if held else
                   f"block {got} is already chosen for this allocation" if got in chosen else
                   f"block {got} is free, not cached")
            raise WorkbenchError(where + f"chose block {got}: {why}; only a candidate (cached, ref_count 0) may "
                                 f"be evicted: [{shown}]")
        return got

    # ---- views --------------------------------------------------------------------------------
    def block_table(self, seq_id: str) -> list[int]:
        return list(self._seq(seq_id).table)

    def slot_mapping(self, seq_id: str, start: int, end: int) -> list[int]:
        """Physical slots of token positions [start, end): ``block_id * B + offset``."""
        s, B = self._seq(seq_id), self.block_size
        if not 0 <= start <= end <= len(s.tokens):
            raise WorkbenchError(f"BlockManager.slot_mapping: [{start}, {end}) is outside sequence {seq_id!r} "
                                 f"of {len(s.tokens)} tokens")
        return slots(s.table, start, end, B)

    def block_states(self) -> list[str]:
        """'free' / 'owned' / 'shared' / 'cached' for every physical block (block-map widget)."""
        return ["shared" if b.ref_count > 1 else "owned" if b.ref_count == 1
                else "cached" if b.id in self._evictable else "free" for b in self.blocks]

    def check_invariants(self) -> None:
        """Assert every bookkeeping invariant (tests call this after every operation)."""
        free, cached = set(self._free), set(self._evictable)
        assert len(free) == len(self._free), "a block is twice in the free list"
        assert not free & cached, f"blocks both free and cached: {free & cached}"
        refs = [0] * self.num_blocks
        B, caching = self.block_size, self.enable_prefix_caching
        for sid, s in self._seqs.items():
            assert len(s.table) == self._blocks_for(len(s.tokens)), f"{sid}: table/tokens length mismatch"
            assert len(set(s.table)) == len(s.table), f"{sid}: a block twice in one table"
            assert 0 <= s.committed <= len(s.tokens), f"{sid}: committed {s.committed} out of range"
            for j, bid in enumerate(s.table):
                refs[bid] += 1
                b = self.blocks[bid]
                assert bid not in free and bid not in cached, f"{sid} uses block {bid}, which is free/cached"
                if b.cid is not None:  # content-identified: must be exactly this prefix's block
                    assert b.tokens == tuple(s.tokens[j * B:(j + 1) * B]), f"{sid}: block {bid} tokens differ"
                    want = self.blocks[s.table[j - 1]].cid if j else None
                    assert b.parent_cid == want, f"{sid}: block {bid} follows another prefix"
                elif caching and j < s.committed // B:
                    raise AssertionError(f"{sid}: committed full block {bid} is not registered")
        index = self.prefix_cache.index
        pending: dict[int, int] = {}
        for b in self.blocks:
            assert b.ref_count >= 0, f"block {b.id} ref_count {b.ref_count}"
            assert b.ref_count == refs[b.id], f"block {b.id} ref_count {b.ref_count}, used by {refs[b.id]} tables"
            in_sets = (b.id in free) + (b.id in cached) + (b.ref_count > 0)
            assert in_sets == 1, f"block {b.id} is in {in_sets} of free/cached/used"
            if b.id in free:
                assert b.cid is None and b.hash is None and b.pending_hash is None, f"free block {b.id} has content"
            if b.id in cached:
                assert b.cid is not None and index.get(b.hash) == b.id, f"cached block {b.id} not indexed"
            if b.pending_hash is not None:
                pending[b.pending_hash] = pending.get(b.pending_hash, 0) + 1
        for h, bid in index.items():
            b = self.blocks[bid]
            assert b.hash == h and b.cid is not None and (b.ref_count > 0 or bid in cached), \
                f"index entry {h:#x} -> block {bid} is stale"
        assert pending == dict(self.prefix_cache.pending), "pending-hash counter out of sync"
        assert len(free) + len(cached) + sum(r > 0 for r in refs) == self.num_blocks
        assert {i for p, i in self._heap if self._evictable.get(i) == p} == cached, "eviction heap lost a block"
