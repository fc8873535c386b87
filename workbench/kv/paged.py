"""Paged KV storage: the tensors behind :class:`~workbench.kv.block_manager.BlockManager`.

The block manager (pure Python) decides *which* physical block holds which tokens; this
module holds the blocks themselves, one pair of tensors per layer::

    k_cache[layer], v_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]

A token at position p of a sequence lives at slot ``block_table[p // B] * B + p % B``
(B = block_size), so viewing a layer's cache as ``[num_blocks * B, nkv, hd]`` and indexing it
with the *slot mapping* writes or reads any set of tokens.

:class:`PagedSequenceCache` is one sequence's view with the cache interface of
:mod:`workbench.model.kv_cache` (what the engine uses when it runs one sequence per step): ``attend``
scatters the new keys/values into their slots and gathers the sequence's blocks back into a
contiguous ``[1, nkv, S, hd]`` for the reference attention.  That gather copies the whole
context every step; the paged decode-attention kernel reads the blocks in place instead.  A
step of many sequences uses :class:`~workbench.kv.batch.PagedBatchCache`.  The scheduler drives
the block manager through :class:`PoolBlocks` (a :class:`~workbench.kv.interface.KVManager`), which
runs this pool's lifecycle around it.
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass

import torch

from workbench.model.config import ModelConfig
from workbench.errors import ConfigError, WorkbenchError
from workbench.kv.block_manager import AllocStatus, Allocation, BlockManager, EvictionPolicy, KVStats
from workbench.kv.interface import PrefixMatch
from workbench.kv.layout import KVLayout
from workbench.kv.kv_prefetch import KVPrefetch, make_tiers, offloaded_prefix
from workbench.measure.timing import ElapsedTotal
from workbench.measure.allocation import check_allocation, format_bytes
from workbench.model.kv_cache import attend_sequences


@dataclass
class PagedKVConfig:
    block_size: int = 16
    num_blocks: int | None = None          # default: max_seqs x min(max_model_len, 2048) tokens; one sequence at
                                           # a time: 4 x max_model_len (room for cached prefixes)
    kv_cache_bytes: int | None = None      # alternatively: a memory budget for the pool
    enable_prefix_caching: bool = True
    eviction: str | EvictionPolicy = "lru"  # "lru", "fifo", or choose_victim(candidates) -> block id
                                           # (workbench.kv.block_manager: every cached block, each eviction)
    offload: str | None = None             # None, "host" or "disk": where evicted cached blocks go
    offload_blocks: int = 4096             # capacity of the offload tier, in blocks
    offload_path: str | None = None        # file for "disk" (default: a temporary file)
    swap_space: str | None = None          # preemption by swapping (SchedulerConfig.preemption_mode="swap"):
                                           # None keeps swapped KV as host tensors, copied synchronously;
                                           # "host" / "disk" put it in a transport's tier (RAM, an O_DIRECT
                                           # file), block by block, and the lookahead stages it before swap-in
    lookahead: int | None = None           # KV prefetch: each step, stage the slower-tier KV of the next
                                           # `lookahead` waiting (and swapped) requests; 0 = off; None: 4 with
                                           # offload or swap_space, else 0
    prefetch_blocks: int | None = None     # staging buffers per tier (blocks); None: 16 x lookahead

    def __post_init__(self) -> None:
        if self.offload not in (None, "host", "disk"):
            raise ConfigError(f"PagedKVConfig.offload must be None, 'host' or 'disk', got {self.offload!r}")
        if self.swap_space not in (None, "host", "disk"):
            raise ConfigError(f"PagedKVConfig.swap_space must be None, 'host' or 'disk', got {self.swap_space!r}")
        tiered = self.offload is not None or self.swap_space is not None
        if self.lookahead is not None and (not isinstance(self.lookahead, int) or isinstance(self.lookahead, bool)
                                           or self.lookahead < 0):
            raise ConfigError(f"PagedKVConfig.lookahead must be an integer >= 0 or None, got {self.lookahead!r}")
        if self.lookahead and not tiered:
            raise ConfigError(f"PagedKVConfig.lookahead={self.lookahead} prefetches from a slower KV tier; set "
                              "offload= and/or swap_space= (or lookahead=0)")
        if self.prefetch_blocks is not None and (not isinstance(self.prefetch_blocks, int) or self.prefetch_blocks < 0):
            raise ConfigError(f"PagedKVConfig.prefetch_blocks must be an integer >= 0, got {self.prefetch_blocks!r}")
        if self.offload is not None and not self.enable_prefix_caching:
            raise ConfigError("PagedKVConfig.offload needs enable_prefix_caching=True (offloaded blocks come back "
                              "through prefix hits)")
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ConfigError(f"PagedKVConfig.block_size must be a positive integer, got {self.block_size!r}")
        for name in ("num_blocks", "offload_blocks", "kv_cache_bytes"):     # counts: a float 1e9 is refused here
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ConfigError(f"PagedKVConfig.{name} must be an integer >= 1, got {v!r}")
        if self.num_blocks is not None and self.kv_cache_bytes is not None:
            raise ConfigError("PagedKVConfig: give num_blocks or kv_cache_bytes, not both")
        if not callable(self.eviction) and self.eviction not in ("lru", "fifo"):
            raise ConfigError(f"PagedKVConfig.eviction must be 'lru', 'fifo' or a function choose_victim(candidates) "
                              f"-> block id, got {self.eviction!r}")

    @property
    def effective_lookahead(self) -> int:
        """``lookahead``, its default resolved: 4 with an offload tier or swap space, else 0."""
        if self.lookahead is not None:
            return self.lookahead
        return 4 if self.offload is not None or self.swap_space is not None else 0


def pool_num_blocks(layout: KVLayout, paged: PagedKVConfig, default_tokens: int, scratch_blocks: int = 0) -> int:
    """The block manager's blocks of a pool: ``paged.num_blocks``, or what ``kv_cache_bytes``
    holds (scratch blocks included), or ``default_tokens`` in blocks.  (The engine's sizing
    plans with this too: :mod:`workbench.engine.sizing`.)"""
    if paged.num_blocks is not None:
        return paged.num_blocks
    if paged.kv_cache_bytes is not None:            # the budget holds the scratch blocks too
        num_blocks = layout.num_blocks_for_bytes(paged.kv_cache_bytes) - scratch_blocks
        if num_blocks < 1:
            raise ConfigError(f"PagedKVConfig.kv_cache_bytes={paged.kv_cache_bytes} holds no block "
                              f"(one block takes {layout.bytes_per_block} bytes)")
        return num_blocks
    return -(-default_tokens // paged.block_size)


class PagedKVPool:
    """Block tensors for every layer plus the block manager that hands them out.

    The tensors' bytes are checked before they are allocated (:mod:`workbench.measure.allocation`):
    more than the device has available, or than ``memory_budget``, is a ConfigError naming the
    figure and ``num_blocks`` (an engine checks its whole plan before it builds the pool:
    :mod:`workbench.engine.sizing`)."""

    def __init__(self, cfg: ModelConfig, paged: PagedKVConfig, device: torch.device, dtype: torch.dtype,
                 default_tokens: int, tensors: bool = True, scratch_blocks: int = 0,
                 memory_budget: int | None = None) -> None:
        self.layout = KVLayout.from_model_config(cfg, paged.block_size, dtype)
        num_blocks = pool_num_blocks(self.layout, paged, default_tokens, scratch_blocks if tensors else 0)
        if tensors:
            stored_blocks = num_blocks + scratch_blocks
            check_allocation("KV pool", stored_blocks * self.layout.bytes_per_block,
                             "PagedKVConfig.num_blocks / --num-blocks", memory_budget, device,
                             f"{stored_blocks:,} blocks x {format_bytes(self.layout.bytes_per_block)} a block")
        self.block_size, self.config, self.device = paged.block_size, paged, device
        shape = (num_blocks, paged.block_size, cfg.num_key_value_heads, cfg.head_dim)
        # tensors=False: block accounting only (an engine whose KV lives in per-sequence caches
        # admits and preempts by the same blocks; nothing is stored here)
        n_layers = cfg.num_hidden_layers if tensors else 0
        # scratch blocks: past the block manager's, owned by no sequence (a static decode step's
        # padding rows write their K/V there); ``scratch_block`` is the first.  num_blocks counts the
        # manager's blocks; a kv_cache_bytes budget holds the scratch blocks too; nbytes() counts them
        stored = (num_blocks + scratch_blocks, *shape[1:])
        self.scratch_block = num_blocks if scratch_blocks and tensors else None
        self.k_cache = [torch.zeros(stored, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v_cache = [torch.zeros(stored, device=device, dtype=dtype) for _ in range(n_layers)]
        self.stores_kv = tensors
        for name in ("offload", "swap_space"):
            if getattr(paged, name) is not None and not tensors:
                raise ConfigError(f"PagedKVConfig.{name} needs the paged KV pool (this engine keeps KV per sequence)")
        # KV prefetch (workbench.kv.kv_prefetch): the offload tier and the swap space fetch through
        # prefetchers; the lookahead stages what the next requests will need
        self.lookahead = paged.effective_lookahead if tensors else 0
        self.offload, self.swap_store = make_tiers(paged, self.lookahead, (cfg.num_hidden_layers, 2, *shape[1:]), dtype,
                                                   device)
        self.kv_prefetch = (KVPrefetch(self, self.lookahead)
                            if self.offload is not None or self.swap_store is not None else None)
        # time of offload restores at admission (reads and writes into the pool): host wall time on a
        # CPU; on CUDA, where a restore only enqueues copies and waits, the stream's time (events)
        self._restore_clock = ElapsedTotal(device)
        self.manager = self._new_manager(num_blocks)
        # Observers (kv-inspect, the live block map): called as fn(event, seq_id) with event
        # "begin" (prompt allocated), "step" (KV committed) or "end" (just before the blocks are freed).
        self.listeners: list = []
        # Wall time spent in block-manager calls (allocate, append_slot, commit, free, restore):
        # the bookkeeping cost of paging and prefix caching, measured directly.
        self.manager_seconds = 0.0
        self.admissions: dict[str, dict] = {}   # live seq id -> allocation, restored blocks, evictions
        # The block manager as an engine's scheduler drives it, with this pool's lifecycle around
        # every call (offload restores, copy-on-write copies, listeners, timing).
        self.blocks = PoolBlocks(self)

    def _notify(self, event: str, seq_id: str) -> None:
        for fn in self.listeners:
            fn(event, seq_id)

    def _new_manager(self, num_blocks: int) -> BlockManager:
        m = BlockManager(num_blocks, self.block_size, enable_prefix_caching=self.config.enable_prefix_caching,
                         eviction=self.config.eviction)
        if self.offload is not None:
            spill = weakref.WeakMethod(self._spill)        # the pool owns its manager: no cycle back
            m.on_evict = lambda *a: spill()(*a)
        return m

    # ---- offload tier --------------------------------------------------------------------------
    def read_block(self, block_id: int) -> torch.Tensor:
        """One block's KV, every layer: [num_layers, 2, block_size, nkv, hd]."""
        return torch.stack([torch.stack((k[block_id], v[block_id])) for k, v in zip(self.k_cache, self.v_cache)])

    def write_block(self, block_id: int, kv: torch.Tensor) -> None:
        for layer, (k, v) in enumerate(zip(self.k_cache, self.v_cache)):
            k[block_id] = kv[layer, 0]
            v[block_id] = kv[layer, 1]

    def _spill(self, block_id: int, block_hash: int, tokens: tuple) -> None:
        if not self.offload.keep(block_hash, tokens):      # a block restored earlier is still there
            self.offload.put(block_hash, tokens, self.read_block(block_id))

    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """Blocks' KV, every layer: [num_layers, 2, len(block_ids), block_size, nkv, hd]."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        return torch.stack([torch.stack((k[idx], v[idx])) for k, v in zip(self.k_cache, self.v_cache)])

    def offloaded_prefix(self, token_ids: list[int], hashes: list[int] | None = None) -> list[tuple[int, tuple]]:
        """``[(hash, tokens)]`` of the prompt's prefix blocks that the offload tier holds and the
        pool does not: what admitting it now would restore (no state change; ``hashes``: the
        prompt's chain, when the caller has it)."""
        return offloaded_prefix(self, token_ids, hashes)[0]

    def _restore(self, token_ids: list[int]) -> int:
        """Copy the prompt's offloaded prefix blocks back (staged copies when the lookahead started
        them).  Every block is read before the block manager registers any: a failed read leaves
        the pool as it was."""
        if not len(self.offload):
            return 0
        with self._restore_clock.region():
            return self._restore_blocks(token_ids)

    @property
    def restore_seconds(self) -> float:
        return self._restore_clock.seconds

    @restore_seconds.setter
    def restore_seconds(self, value: float) -> None:
        self._restore_clock.reset(value)

    def _restore_blocks(self, token_ids: list[int]) -> int:
        want, cached_hits = offloaded_prefix(self, token_ids)
        kvs: dict[int, tuple] = {}
        for h, tokens in want[:max(0, self.manager.num_available_blocks - cached_hits)]:
            kv = self.offload.get(h, tokens, self.device)
            if kv is None:
                break
            kvs[h] = (tokens, kv)
        restored = self.manager.restore_prefix(token_ids, lambda h, t: h in kvs and kvs[h][0] == t)
        if restored:              # one copy per layer and K / V for all the blocks
            idx = torch.tensor([b for b, _, _ in restored], dtype=torch.long, device=self.device)
            kv = torch.stack([kvs[h][1] for _, h, _ in restored], dim=2)     # [L, 2, n, B, nkv, hd]
            for layer, (k, v) in enumerate(zip(self.k_cache, self.v_cache)):
                k[idx] = kv[layer, 0]
                v[idx] = kv[layer, 1]
        return len(restored)

    def prefetch_stats(self) -> dict | None:
        """The KV prefetcher's counters (offload restores and swap-ins together, and per source
        under ``"sources"``): prefetch_hit_rate, stall_s, bytes, achieved_gbps,
        prefetch_efficiency, restore_s_on_critical_path / restore_s_hidden (and the hidden
        share), wasted prefetches.  None without an offload tier or swap space."""
        return None if self.kv_prefetch is None else self.kv_prefetch.stats()

    def close(self) -> None:
        """Give back the slower tiers (worker threads, a disk tier's temporary file)."""
        for store in (self.offload, self.swap_store):
            if store is not None:
                store.close()

    def reset(self) -> None:
        """Forget every block (cached prefixes included, and those in the offload tier); the
        tensors stay allocated."""
        if self.manager.num_used_blocks:
            raise WorkbenchError(f"KV pool reset with {self.manager.num_used_blocks} blocks still in use")
        self.manager = self._new_manager(self.num_blocks)
        if self.offload is not None:
            self.offload.forget()

    @property
    def num_blocks(self) -> int:
        return self.manager.num_blocks

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_cache + self.v_cache)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: duplicate block ``src`` into ``dst`` in every layer."""
        if not pairs or not self.stores_kv:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for cache in self.k_cache + self.v_cache:
            cache[dst] = cache[src]

    # ---- one sequence's life: allocate -> (append_slot, forward, commit)* -> free ------------
    def begin(self, seq_id: str, token_ids: list[int]) -> tuple[PagedSequenceCache, object]:
        """Allocate the prompt's blocks (reusing cached prefix blocks); returns the sequence's
        cache view, positioned after the reused tokens, and the block manager's allocation.
        With an offload tier, evicted prefix blocks it still holds are copied back first."""
        alloc = self.blocks.allocate(seq_id, token_ids)
        if alloc is None:
            need = -(-len(token_ids) // self.block_size)
            why = ("more than the whole pool" if self.manager.can_allocate(len(token_ids)) == AllocStatus.NEVER
                   else f"only {self.manager.num_available_blocks} available now")
            raise WorkbenchError(
                f"KV pool: {need} blocks needed for a {len(token_ids)}-token prompt, {why} (pool of "
                f"{self.num_blocks} blocks of {self.block_size} tokens); give the pool more blocks "
                "(PagedKVConfig.num_blocks / kv_cache_bytes)")
        return PagedSequenceCache(self, seq_id, alloc.num_cached_tokens), alloc

    def reserve(self, seq_id: str, token_id: int) -> None:
        """Reserve the slot of the next token fed to the model (copy-on-write if shared)."""
        if self.blocks.append_slot(seq_id, token_id) is None:
            raise WorkbenchError(f"KV pool: no free block for sequence {seq_id} at "
                                 f"{len(self.manager.block_table(seq_id)) * self.block_size} tokens "
                                 f"({self.num_blocks} blocks of {self.block_size}); give the pool more blocks")

    def commit(self, seq_id: str, num_tokens: int) -> None:
        """The KV of the sequence's first ``num_tokens`` tokens is written: full blocks become reusable."""
        self.blocks.commit(seq_id, num_tokens)

    def end(self, seq_id: str) -> None:
        self.blocks.free(seq_id)


class PoolBlocks:
    """The pool's :class:`~workbench.kv.interface.KVManager` (what an engine's scheduler drives):
    every call goes to the block manager (``pool.manager``), and those that change state run the
    pool's lifecycle at fixed points around it:

    * :meth:`_before_allocate` (``allocate``): the offload tier's blocks of the prompt's prefix are
      restored (their KV copied in), so the allocation hits them;
    * :meth:`_after_change` (``allocate``, ``append_slot``): copy-on-write copies are done before
      anything writes;
    * :meth:`_announce` (listeners): ``"begin"`` after ``allocate`` and ``fork``, ``"step"`` after
      ``commit``, ``"end"`` before ``free``;
    * :meth:`_timed`: every manager call (a restore included) adds its wall time to
      ``pool.manager_seconds``, the bookkeeping cost of paging.

    ``allocate`` and ``fork`` keep what they did in ``pool.admissions`` until the sequence is freed
    (a fork as an allocation whose whole prompt was reused: no prefix-cache hit in the stats).
    """

    def __init__(self, pool: PagedKVPool) -> None:
        # a weak proxy: the pool owns this object (``pool.blocks``), and a strong reference back
        # made a cycle that kept the pool's KV tensors alive after its engine was dropped, until
        # Python's cyclic collector ran (on a GPU: gigabytes of HBM held between engines)
        self.pool = weakref.proxy(pool)

    @property
    def manager(self) -> BlockManager:
        """The pool's block manager now (``PagedKVPool.reset`` replaces it)."""
        return self.pool.manager

    # ---- the pool's lifecycle around the manager -------------------------------------------------
    def _timed(self, call, *args):
        """``call(*args)``, its wall time added to ``pool.manager_seconds``."""
        t0 = time.perf_counter()
        try:
            return call(*args)
        finally:
            self.pool.manager_seconds += time.perf_counter() - t0

    def _before_allocate(self, token_ids: list[int], reuse: bool) -> int:
        """Restore the prompt's offloaded prefix blocks into the pool; returns how many."""
        pool = self.pool
        return pool._restore(token_ids) if pool.offload is not None and reuse else 0

    def _after_change(self) -> None:
        """Do the copy-on-write copies the manager asked for."""
        self.pool.copy_blocks(self.pool.manager.take_copies())

    def _announce(self, event: str, seq_id: str) -> None:
        """Tell the pool's listeners: ``"begin"``, ``"step"`` or ``"end"``."""
        self.pool._notify(event, seq_id)

    # ---- facts: the manager's -----------------------------------------------------------------------
    @property
    def block_size(self) -> int:
        return self.pool.manager.block_size

    @property
    def num_blocks(self) -> int:
        return self.pool.manager.num_blocks

    @property
    def num_available_blocks(self) -> int:
        return self.pool.manager.num_available_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.pool.manager.num_cached_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.manager.num_used_blocks

    @property
    def stats(self) -> KVStats:
        return self.pool.manager.stats

    def num_tokens(self, seq_id: str) -> int:
        return self.pool.manager.num_tokens(seq_id)

    def block_table(self, seq_id: str) -> list[int]:
        return self.pool.manager.block_table(seq_id)

    def block_refs(self, block_id: int) -> int:
        return self.pool.manager.block_refs(block_id)

    def match_prefix(self, token_ids: list[int], reuse: bool = True) -> PrefixMatch:
        return self.pool.manager.match_prefix(token_ids, reuse)

    def cached_prefix_tokens(self, token_ids: list[int]) -> int:
        return self.pool.manager.cached_prefix_tokens(token_ids)

    def can_allocate(self, num_tokens: int, token_ids: list[int] | None = None, reuse: bool = True) -> AllocStatus:
        return self.pool.manager.can_allocate(num_tokens, token_ids, reuse)

    # ---- changes: the manager's, with the lifecycle around them -------------------------------------
    def allocate(self, seq_id: str, token_ids: list[int], reuse: bool = True) -> Allocation | None:
        pool, m = self.pool, self.pool.manager
        evictions = m.stats.evictions

        def restore_and_allocate():
            return self._before_allocate(token_ids, reuse), m.allocate(seq_id, token_ids, reuse)

        restored, alloc = self._timed(restore_and_allocate)
        if alloc is None:
            return None
        self._after_change()
        # What admitting this request did, for inspectors (kept until the request ends).
        pool.admissions[seq_id] = {"allocation": alloc, "restored_blocks": restored,
                                   "evictions": m.stats.evictions - evictions}
        self._announce("begin", seq_id)
        return alloc

    def fork(self, parent_id: str, child_id: str) -> None:
        pool, m = self.pool, self.pool.manager
        self._timed(m.fork, parent_id, child_id)
        n = m.num_tokens(child_id)
        # not in m.stats: a fork is no prefix-cache hit, and the hit rate should not count it
        pool.admissions[child_id] = {"allocation": Allocation(child_id, m.block_table(child_id), n, n, None, n),
                                     "restored_blocks": 0, "evictions": 0, "fork_of": parent_id}
        self._announce("begin", child_id)

    def append_slot(self, seq_id: str, token_id: int) -> int | None:
        slot = self._timed(self.pool.manager.append_slot, seq_id, token_id)
        self._after_change()
        return slot

    def commit(self, seq_id: str, num_tokens_computed: int) -> None:
        self._timed(self.pool.manager.commit, seq_id, num_tokens_computed)
        self._announce("step", seq_id)

    def free(self, seq_id: str) -> None:
        try:
            self._announce("end", seq_id)
        finally:
            self.pool.admissions.pop(seq_id, None)
            self._timed(self.pool.manager.free, seq_id)


class PagedSequenceCache:
    """One sequence's view of the pool, with the contiguous cache's interface.

    ``length`` is the number of tokens whose KV is in the pool (after a prefix-cache hit it
    starts at the number of reused tokens).  Before a forward over positions
    ``[length, length + T)`` the caller reserves their slots with the block manager.
    """

    def __init__(self, pool: PagedKVPool, seq_id: str, length: int = 0) -> None:
        self.pool, self.seq_id, self.length = pool, seq_id, length
        self._key: tuple[int, int] | None = None
        self._slots = self._blocks = None

    def _prepare(self, start: int, end: int) -> None:
        """Slot mapping of the new tokens and block ids of the whole context, once per forward."""
        if self._key == (start, end):
            return
        m, dev = self.pool.manager, self.pool.device
        self._slots = torch.tensor(m.slot_mapping(self.seq_id, start, end), device=dev)
        nb = -(-end // self.pool.block_size)
        self._blocks = torch.tensor(m.block_table(self.seq_id)[:nb], device=dev)
        self._key = (start, end)

    def _write(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        if k.shape[0] != 1:
            raise ValueError(f"a paged sequence view holds one sequence, got batch {k.shape[0]}")
        kc, vc = self.pool.k_cache[layer], self.pool.v_cache[layer]
        nkv, hd = kc.shape[2], kc.shape[3]
        kc.view(-1, nkv, hd)[self._slots] = k[0].transpose(0, 1)
        vc.view(-1, nkv, hd)[self._slots] = v[0].transpose(0, 1)

    def _context(self, layer: int, end: int):
        kc, vc = self.pool.k_cache[layer], self.pool.v_cache[layer]
        nkv, hd = kc.shape[2], kc.shape[3]
        keys = kc[self._blocks].reshape(-1, nkv, hd)[:end]       # [S, nkv, hd]
        vals = vc[self._blocks].reshape(-1, nkv, hd)[:end]
        return keys.transpose(0, 1).unsqueeze(0), vals.transpose(0, 1).unsqueeze(0)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Scatter k/v [1, nkv, T, hd] into their slots; gather the context [1, nkv, S, hd]."""
        end = start + k.shape[2]
        self._prepare(start, end)
        self._write(layer, k, v)
        return self._context(layer, end)

    # ---- the attention interface (workbench.model.kv_cache) ----------------------------------------
    def attend(self, attn, q, k, v, start: int, written: bool = False) -> torch.Tensor:
        """Write this step's k/v into the pool and attend over the sequence's blocks: in place
        with a decode kernel, else gathered to a contiguous context (the reference)."""
        layer, end = attn.layer_idx, start + q.shape[2]
        self._prepare(start, end)
        if not written:
            self._write(layer, k, v)
        return attend_sequences(self, attn, q, start, lambda: self._blocks.to(torch.int32)[None],
                                lambda: self._context(layer, end))

    def kv_storage(self, layer: int):
        return self.pool.k_cache[layer], self.pool.v_cache[layer]

    def write_slots(self, B: int, start: int, T: int) -> torch.Tensor:
        if B != 1:
            raise ValueError(f"a paged sequence view holds one sequence, got batch {B}")
        self._prepare(start, start + T)
        return self._slots
