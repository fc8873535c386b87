"""What the scheduler (and the engine's step) may ask of the KV blocks: :class:`KVManager`.

Two classes implement it: :class:`~workbench.kv.block_manager.BlockManager`, the bookkeeping
alone (what the pure-Python scheduler tests drive), and :class:`~workbench.kv.paged.PoolBlocks`,
the same calls with a paged pool's lifecycle around those that change state (offload restores,
copy-on-write copies, listeners, timing); an engine gives its scheduler the latter.  ::

    m.match_prefix(prompt)              # PrefixMatch: what allocate would reuse now (no state change)
    m.can_allocate(len(prompt), prompt) # AllocStatus.OK / LATER / NEVER, counting those hits
    m.allocate("r1", prompt)            # Allocation, or None (nothing changed)
    m.append_slot("r1", token)          # the next token's slot, or None when no block can be had
    m.commit("r1", n)                   # the KV of the first n tokens is written
    m.free("r1")

Pure Python, like the scheduler that uses it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from workbench.kv.blocks import AllocStatus, Allocation, KVStats

__all__ = ["KVManager", "PrefixMatch", "AllocStatus", "Allocation", "KVStats"]   # the last three: what its calls return


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The cached prefix blocks a prompt would reuse if it were allocated now
    (:meth:`KVManager.match_prefix`)."""
    block_ids: tuple[int, ...]   # the hit blocks, in prompt order
    cached_tokens: int           # prompt tokens they hold: len(block_ids) * block_size
    unheld: int                  # hits no sequence holds (cached, evictable): allocating takes them
                                 # from the available blocks, as it takes a new block

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)


@runtime_checkable
class KVManager(Protocol):
    """The block calls of :class:`~workbench.sched.scheduler.Scheduler` and the engine's step."""

    # ---- facts (no state change) ---------------------------------------------------------------
    @property
    def block_size(self) -> int: ...

    @property
    def num_blocks(self) -> int: ...

    @property
    def num_available_blocks(self) -> int:
        """Blocks a request can get now: free plus evictable cached."""

    @property
    def num_cached_blocks(self) -> int:
        """Blocks no sequence holds that keep a committed prefix for later prompts."""

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by sequences."""

    @property
    def stats(self) -> KVStats: ...

    def num_tokens(self, seq_id: str) -> int:
        """Tokens of the sequence that have a slot."""

    def block_table(self, seq_id: str) -> list[int]:
        """The sequence's blocks, in order (a copy)."""

    def block_refs(self, block_id: int) -> int:
        """How many sequences hold the block now (0: free or cached)."""

    def match_prefix(self, token_ids: list[int], reuse: bool = True) -> PrefixMatch:
        """The prefix blocks :meth:`allocate` would reuse for this prompt now; ``reuse=False``:
        none."""

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        """Prompt tokens :meth:`allocate` would reuse now."""

    def can_allocate(self, num_tokens: int, token_ids: list[int] | None = None, reuse: bool = True) -> AllocStatus:
        """Would a prompt of ``num_tokens`` tokens fit now (``token_ids``: count its prefix hits)?"""

    # ---- changes ---------------------------------------------------------------------------------
    def allocate(self, seq_id: str, token_ids: list[int], reuse: bool = True) -> Allocation | None:
        """Blocks for a new sequence's prompt; None (nothing changed) when they cannot be had now."""

    def append_slot(self, seq_id: str, token_id: int) -> int | None:
        """Reserve the next token's slot; None (nothing changed) when a block is needed and none
        can be had."""

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child shares every block of the parent."""

    def commit(self, seq_id: str, num_tokens_computed: int) -> None:
        """The KV of the sequence's first ``num_tokens_computed`` tokens is written."""

    def free(self, seq_id: str) -> None:
        """Drop the sequence; its committed full blocks stay cached."""
