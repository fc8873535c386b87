"""The records the block manager keeps: blocks, allocations, statistics.

Pure Python, like :mod:`workbench.kv.block_manager`, which is their only writer.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
from dataclasses import dataclass, field

from workbench.errors import WorkbenchError
from workbench.kv.prefix_cache import MissReason


@dataclass(slots=True, eq=False)
class Block:
    id: int
    ref_count: int = 0
    # Set when the block is full and committed (prefix caching on): its content identity.
    hash: int | None = None            # chain hash (index key)
    tokens: tuple | None = None        # the block's tokens, checked on every hit
    cid: int | None = None             # content id of the whole prefix ending here
    parent_cid: int | None = None      # content id of the previous block's prefix
    born: int = 0                      # tick of commit: FIFO eviction order
    pending_hash: int | None = None    # hash it will get once committed (for NOT_COMPUTED)
    last_used: int = 0                 # tick at which its last user let go: LRU eviction order
    hits: int = 0                      # prefix hits on its content since it was committed
    depth: int = 0                     # its index in its prompt's chain (0: a prompt's first block)

    def reset(self) -> None:
        self.hash = self.tokens = self.cid = self.parent_cid = self.pending_hash = None
        self.hits = self.depth = 0


@dataclass(frozen=True, slots=True)
class EvictionCandidate:
    """A cached block (ref_count 0) that an eviction policy may choose when the free list is empty
    (``BlockManager(eviction=choose_victim)``, ``choose_victim(candidates) -> block_id``).

    Ticks come from one clock of the block manager, which advances on every commit of a full block
    and every release of a cached one: larger is later.  ``parent`` and ``children`` describe the
    prefix tree: a block is reachable by a later prompt only through its parent (the hash chain), so
    a *leaf* (``children == 0``) is the one whose loss costs no other cached block its use."""
    block_id: int
    last_used: int        # tick when its last user let go (LRU evicts the smallest)
    born: int             # tick when its KV was committed (FIFO evicts the smallest)
    hits: int             # how many later prompts reused it since it was committed
    depth: int            # its index in its prompt's chain: 0 is the first block of a prompt
    parent: int | None    # the block holding the previous block of its prefix (cached, or held by a
                          # sequence); None for a first block, or when that block was evicted
    children: int         # cached blocks that continue its prefix (their parent is this block)


class AllocStatus(enum.Enum):
    OK = "ok"          # enough blocks now
    LATER = "later"    # not enough free (or evictable) blocks now; may fit after others free
    NEVER = "never"    # more blocks than the whole pool has


@dataclass
class Allocation:
    """What :meth:`BlockManager.allocate` did for one request."""
    seq_id: str
    block_table: list[int]
    num_cached_tokens: int            # prompt tokens whose KV was reused (multiple of block_size)
    prompt_tokens: int
    miss_reason: MissReason | None    # why not more was reused; None: full hit
    cacheable_tokens: int             # the most that could be reused: ((n - 1) // B) * B

    @property
    def hit_tokens(self) -> int:
        return self.num_cached_tokens


@dataclass
class KVStats:
    """Global counters; every field is JSON-friendly (``dataclasses.asdict`` / ``vars``)."""
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    hit_rate: float = 0.0              # hit_tokens / prompt_tokens
    full_hits: int = 0                 # requests with miss_reason None and at least one block hit
    partial_hits: int = 0              # some blocks hit, then the chain stopped
    misses: dict = field(default_factory=dict)  # MissReason.value -> requests that stopped for it
    evictions: int = 0
    cow_copies: int = 0
    restored_blocks: int = 0           # evicted blocks brought back from a slower tier (offload)

    def record(self, a: Allocation) -> None:
        self.requests += 1
        self.prompt_tokens += a.prompt_tokens
        self.hit_tokens += a.num_cached_tokens
        self.hit_rate = self.hit_tokens / self.prompt_tokens
        if a.miss_reason is None:
            self.full_hits += a.num_cached_tokens > 0
        else:
            self.partial_hits += a.num_cached_tokens > 0
            self.misses[a.miss_reason.value] = self.misses.get(a.miss_reason.value, 0) + 1

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _as_token_ids(token_ids, where: str) -> list[int]:
    try:
        return [operator.index(t) for t in token_ids]  # ints, numpy / torch integer scalars
    except TypeError:
        raise WorkbenchError(f"{where}: token ids must be integers, got {list(token_ids)[:8]!r}") from None


@dataclass
class _Seq:
    tokens: list[int]      # every token with a reserved slot (prompt + appended)
    table: list[int]       # block ids; len == ceil(len(tokens) / B)
    committed: int         # tokens whose KV is written
