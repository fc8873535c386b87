"""Prefix cache: find full KV blocks that an earlier request already computed, and say why not.

A block of ``B`` tokens is identified by a *hash chain*: ``h_i = H(h_{i-1}, tokens_i)`` with
``h_{-1} = None``, so equal hashes mean (up to collisions) equal *whole prefixes*, which is what
KV depends on: the keys of token 5 depend on tokens 0..5, not on token 5 alone.  ::

    prompt  [7 3 9 1 | 4 4 2 8 | 6 5]           block_size 4
    hashes   h0=H(None,(7,3,9,1))  h1=H(h0,(4,4,2,8))   (the partial tail is never cached)

Hashes are only an index.  A hit is always *verified*, never trusted:

* the cached block's tokens must equal the request's block tokens, and
* its parent must be the block we just matched.  Each distinct verified prefix gets a content
  id (``cid``); a block stores its own ``cid`` and its parent's, and a candidate for position
  ``i`` must carry ``parent_cid == cid of the block hit at i-1``.  Checking the tokens of the
  block alone is not enough: with a colliding hash, the cached block ``(1, 2)`` at position 0
  would be "reused" for ``(1, 2)`` at position 2 — same tokens, different keys.

So a hash collision (tests force one by making :func:`block_hash` a constant) can cost a miss,
never a wrong block.

Miss reasons: why the chain stopped at block ``i`` (the first block not reused) — a
diagnostic, decided from what this object remembers, in this order:

``NOT_COMPUTED``       the block's content has been allocated by a request but its KV is not
                       committed yet (a request in flight), or it was seen in a prompt whose
                       request ended before computing it.  (Our extra: the usual reason why
                       identical requests submitted together do not share.)
``EVICTED``            a block with that hash was cached and has been evicted (bounded memory
                       of the last ``history`` evicted hashes; older evictions are forgotten).
``SHORTER_THAN_BLOCK`` an earlier prompt shares at least ``min_shared_tokens`` tokens of
                       block ``i`` with this one (after the same ``i`` full blocks), but not the
                       whole block: the shared prefix ends inside a block, so it cannot be
                       reused.  Known only against the prompts remembered (the last
                       ``children_per_parent`` distinct blocks after each prefix, last
                       ``history`` prefixes); with ``min_shared_tokens=1`` a common BOS token
                       alone counts as sharing — raise it if every prompt starts the same way.
``NO_SHARED_PREFIX``   none of the above: nothing remembered shares a token of block ``i``.
``DISABLED``           prefix caching is off (decided by the block manager).

``None`` means a full hit: every full block before the final token was reused (the final token
is always computed, so a prompt of ``n`` tokens can reuse at most ``(n - 1) // B`` blocks).
When ``(n - 1) // B == 0`` nothing can be reused; the reason then says whether an earlier
prompt shared a prefix (``SHORTER_THAN_BLOCK``) or not (``NO_SHARED_PREFIX``).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence


class MissReason(str, enum.Enum):
    """Why a request's prefix-cache lookup stopped before its last full block."""
    NO_SHARED_PREFIX = "no_shared_prefix"
    SHORTER_THAN_BLOCK = "shorter_than_block"
    EVICTED = "evicted"
    DISABLED = "disabled"
    NOT_COMPUTED = "not_computed"
    FULL_PROMPT = "full_prompt"       # the request computes its whole prompt (it asked for prompt logprobs)


def block_hash(parent: int | None, tokens: Sequence[int]) -> int:
    """Stable 64-bit hash of (parent hash, block tokens): the same on every run and machine
    (unlike Python's ``hash``, which is salted per process for str/bytes)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little"))
    h.update(struct.pack(f"<{len(tokens)}q", *tokens))
    return int.from_bytes(h.digest(), "little")


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """The hash index over cached blocks plus what is remembered to explain misses.

    ``blocks`` is the block manager's list of physical blocks (objects with ``tokens``, ``cid``
    and ``parent_cid``); this class reads it to verify hits and never changes it.
    """

    def __init__(self, blocks: list, block_size: int, history: int = 4096,
                 children_per_parent: int = 16, hash_fn: Callable | None = None) -> None:
        self.blocks = blocks
        self.block_size = block_size
        self.history = history
        self.children_per_parent = children_per_parent
        self.min_shared_tokens = 1
        self.hash_fn = hash_fn  # None: the module's block_hash (looked up per call: monkeypatchable)
        self.index: dict[int, int] = {}  # hash -> block id holding that content (live or cached)
        # hash -> (tokens, parent_cid, cid) of evicted content, oldest first, bounded
        self.evicted: OrderedDict[int, tuple] = OrderedDict()
        # parent hash (None = start of prompt) -> block token tuples seen after it, bounded
        self.seen: OrderedDict[int | None, list[tuple[int, ...]]] = OrderedDict()
        self.pending: Counter[int] = Counter()  # hash -> allocated full blocks not yet committed
        self._next_cid = 0

    def hash(self, parent: int | None, tokens: Sequence[int]) -> int:
        return (self.hash_fn or block_hash)(parent, tokens)

    def chain(self, token_ids: Sequence[int]) -> list[int]:
        """Hashes of every full block of ``token_ids``."""
        B, out, parent = self.block_size, [], None
        for i in range(len(token_ids) // B):
            parent = self.hash(parent, tuple(token_ids[i * B:(i + 1) * B]))
            out.append(parent)
        return out

    # ---- hits --------------------------------------------------------------------------------
    def lookup(self, h: int, tokens: tuple, parent_cid: int | None) -> int | None:
        """Block id holding exactly this prefix, or None. Verified, not trusted (module doc)."""
        bid = self.index.get(h)
        if bid is None:
            return None
        b = self.blocks[bid]
        return bid if b.tokens == tokens and b.parent_cid == parent_cid else None

    def content_id(self, h: int, tokens: tuple, parent_cid: int | None) -> int:
        """The cid of this verified prefix: reused when the index or the eviction memory holds the
        same (tokens, parent cid) — so children of an evicted-then-recomputed block are
        reachable again — otherwise a fresh one. Equal cids imply equal prefixes (induction on
        the parent cid), which is what makes :meth:`lookup` sound."""
        bid = self.index.get(h)
        if bid is not None and self.blocks[bid].tokens == tokens and self.blocks[bid].parent_cid == parent_cid:
            return self.blocks[bid].cid
        ev = self.evicted.get(h)
        if ev is not None and ev[0] == tokens and ev[1] == parent_cid:
            return ev[2]
        self._next_cid += 1
        return self._next_cid

    def register(self, h: int, block_id: int) -> bool:
        """Index a block whose KV is now written. A hash already indexed keeps its first block
        (the newcomer is a duplicate and goes back to the free list when released)."""
        if h in self.index:
            return False
        self.index[h] = block_id
        self.evicted.pop(h, None)
        return True

    def on_evict(self, h: int, tokens: tuple, parent_cid: int | None, cid: int) -> None:
        del self.index[h]
        self.evicted[h] = (tokens, parent_cid, cid)
        self.evicted.move_to_end(h)
        while len(self.evicted) > self.history:
            self.evicted.popitem(last=False)

    # ---- misses ------------------------------------------------------------------------------
    def remember(self, parent: int | None, tokens: tuple) -> None:
        """Record that a prompt had ``tokens`` (a full block or its partial tail) after the prefix
        whose chain hash is ``parent``."""
        kids = self.seen.get(parent)
        if kids is None:
            kids = self.seen[parent] = []
            while len(self.seen) > self.history:
                self.seen.popitem(last=False)
        else:
            self.seen.move_to_end(parent)
        if tokens in kids:
            kids.remove(tokens)
        kids.append(tokens)
        del kids[:-self.children_per_parent]

    def shared_tokens(self, parent: int | None, tokens: Sequence[int]) -> int:
        """Longest common prefix of ``tokens`` with any remembered block after ``parent``."""
        return max((common_prefix_len(k, tokens) for k in self.seen.get(parent, ())), default=0)

    def miss_reason(self, parent: int | None, h: int | None, tokens: Sequence[int]) -> MissReason:
        """Why block ``tokens`` (hash ``h``; None for a prompt with no reusable block, whose
        ``tokens`` are then its tokens before the final one) after prefix ``parent`` missed."""
        if h is not None:
            if self.pending[h] > 0:
                return MissReason.NOT_COMPUTED
            if h in self.evicted:
                return MissReason.EVICTED
            bid = self.index.get(h)
            if bid is not None and self.blocks[bid].tokens == tuple(tokens):
                # same hash and tokens, other parent cid: the parent's content was evicted and
                # recomputed after the eviction memory forgot it; this copy is unreachable
                return MissReason.EVICTED
        shared = self.shared_tokens(parent, tokens)
        if h is not None and shared == self.block_size:
            return MissReason.NOT_COMPUTED  # seen whole, never committed (its request ended first)
        if shared >= self.min_shared_tokens:
            return MissReason.SHORTER_THAN_BLOCK
        return MissReason.NO_SHARED_PREFIX
