"""KV prefetch: offloaded prefix blocks and swapped-out sequences, staged ahead of their use.

Two kinds of KV wait in a slower tier until a request needs them again: prefix blocks the
prefix cache evicted to the offload tier (:mod:`workbench.kv.offload`), restored when a prompt
that shares the prefix is admitted, and the KV of sequences preempted by swapping
(``PagedKVConfig(swap_space="host" | "disk")``), restored at swap-in.  Both go through a
:class:`~workbench.prefetch.prefetcher.Prefetcher`, so the copy can start *before* the moment of
use.  What to start comes from the scheduler: every engine step :class:`KVPrefetch` asks for the
next ``lookahead`` waiting requests in admission order and the next ``lookahead`` swapped ones
in swap-in order (:meth:`~workbench.sched.scheduler.Scheduler.lookahead`), works out which of
their blocks sit in a slower tier (not in the pool) and submits those into staging buffers; the
copies run on the transport's worker while the model computes the step.

* :class:`~workbench.kv.offload.Staging` (with the stores) - a bounded set of block-sized
  buffers (made once, from ``transport.buffer``: aligned host memory for a disk or RAM tier,
  device memory on CUDA).  At the moment of use a staged copy that has landed is a prefetch
  *hit*; one still in flight stalls for its remainder; a block nobody staged (a late or
  mispredicted lookahead) is a *demand* fetch that stalls for all of it - never an
  approximation.
* :func:`make_tiers` - the offload store and swap store a :class:`PagedKVConfig` asks for;
* :class:`SwapStore` - swapped-out sequences' KV, block by block, in a transport's tier.
* :class:`KVPrefetch` - the lookahead: what to stage each step, what to let go (requests that
  left the lookahead window, aborted requests), and the statistics
  (:meth:`~workbench.kv.paged.PagedKVPool.prefetch_stats`).

Restore time: per use, the time the engine waited for the bytes is *on the critical path*; the
copy time it did not wait for is *hidden*.  A staged block is only ever used after its tokens
are verified again (the store checks them on every read), and a block dropped from the tier
while its copy is in flight is never used.
"""

from __future__ import annotations

import weakref

import math
import time

import torch

from workbench.errors import WorkbenchError
from workbench.measure.timing import ElapsedTotal
from workbench.kv.offload import DiskOffload, HostOffload, Staging
from workbench.prefetch.prefetcher import Prefetcher
from workbench.prefetch.transports import make_transport


def make_tiers(paged, lookahead: int, block_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """``(offload store or None, swap store or None)`` for a
    :class:`~workbench.kv.paged.PagedKVConfig`, with ``prefetch_blocks`` staging buffers each
    (default 16 per lookahead request; none without lookahead)."""
    staging = paged.prefetch_blocks if paged.prefetch_blocks is not None else 16 * lookahead
    offload = None
    if paged.offload == "host":
        offload = HostOffload(paged.offload_blocks, block_shape=block_shape, dtype=dtype, device=device,
                              staging_blocks=staging)
    elif paged.offload == "disk":
        offload = DiskOffload(paged.offload_blocks, block_shape, dtype, paged.offload_path, staging_blocks=staging)
    swap = None
    if paged.swap_space is not None:     # "host" on a CUDA pool: pinned host memory, copied on a side stream
        kind = "cuda" if paged.swap_space == "host" and device.type == "cuda" else paged.swap_space
        swap = SwapStore(Prefetcher(make_transport(kind, device), name=f"kv-swap-{paged.swap_space}"),
                         block_shape, dtype, staging)
    return offload, swap


def offloaded_prefix(pool, token_ids: list[int], hashes: list[int] | None = None,
                     evictable: bool = False) -> tuple[list[tuple[int, tuple]], int]:
    """``([(hash, tokens)] of the prompt's prefix blocks past those the pool holds, that the
    offload tier holds, cached pool hits with no user)``: the chain walk of
    :meth:`~workbench.kv.block_manager.BlockManager.restore_prefix`, without changing state.
    ``evictable``: also the pool's hits that no sequence uses (cached, so the next admission may
    evict them) when the offload tier holds a copy - what a lookahead stages to be safe."""
    m, store = pool.manager, pool.offload
    if store is None or not len(store) or not m.enable_prefix_caching:
        return [], 0
    pc, B = m.prefix_cache, m.block_size
    hashes = pc.chain(token_ids) if hashes is None else hashes
    limit = (len(token_ids) - 1) // B               # the final token is always computed
    i, parent_cid, idle_hits = 0, None, 0
    out = []
    while i < limit:                                 # the blocks the pool holds (verified hits)
        tokens = tuple(token_ids[i * B:(i + 1) * B])
        bid = pc.lookup(hashes[i], tokens, parent_cid)
        if bid is None:
            break
        parent_cid = m.blocks[bid].cid
        idle = m.blocks[bid].ref_count == 0
        idle_hits += idle
        if evictable and idle and store.holds(hashes[i], tokens):
            out.append((hashes[i], tokens))
        i += 1
    for j in range(i, limit):
        tokens = tuple(token_ids[j * B:(j + 1) * B])
        if hashes[j] in pc.index or not store.holds(hashes[j], tokens):
            break
        out.append((hashes[j], tokens))
    return out, idle_hits


def _merge(parts: list[tuple[Prefetcher, Staging]]) -> dict:
    """Counters of several (prefetcher, staging) pairs added up, rates from the sums."""
    keys = ("fetches", "predicted", "demand", "uses", "hits", "stall_s", "bytes", "copy_s")
    tot = dict.fromkeys(keys, 0)
    crit = hidden = 0.0
    wasted = wasted_bytes = staged = cap = 0
    for pf, st in parts:
        s = pf.stats()
        for k in keys:
            tot[k] += s[k]
        if pf.transport.kind == "cuda":
            crit += s["stall_s"]
            hidden += max(0.0, s["copy_s"] - s["stall_s"])
        else:
            crit += st.on_critical_s
            hidden += st.hidden_s
        wasted, wasted_bytes = wasted + st.wasted, wasted_bytes + st.wasted_bytes
        staged, cap = staged + len(st.staged_keys()), cap + st.capacity
    out = dict(tot)
    out["prefetch_hit_rate"] = tot["hits"] / tot["uses"] if tot["uses"] else None
    out["achieved_gbps"] = tot["bytes"] / tot["copy_s"] / 1e9 if tot["copy_s"] else None
    out["prefetch_efficiency"] = (min(1.0, max(0.0, 1.0 - tot["stall_s"] / tot["copy_s"]))
                                  if tot["copy_s"] else None)
    out["restore_s_on_critical_path"] = crit
    out["restore_s_hidden"] = hidden
    out["restore_hidden_share"] = hidden / (crit + hidden) if crit + hidden > 0 else None
    out.update(wasted_prefetches=wasted, wasted_bytes=wasted_bytes, staged_now=staged, staging_blocks=cap)
    return out


class SwapStore:
    """Swapped-out sequences' KV in a transport's tier, one entry per block (``[L, 2, B, nkv, hd]``,
    the whole block), so a swap-in reads only the blocks the prefix cache does not cover and the
    lookahead stages them in block-sized buffers.  ``put`` is synchronous (the swap-out)."""

    def __init__(self, prefetcher: Prefetcher, block_shape: tuple[int, ...], dtype: torch.dtype,
                 staging_blocks: int) -> None:
        self.prefetcher, self.transport = prefetcher, prefetcher.transport
        self.block_shape, self.dtype = tuple(block_shape), dtype
        self.block_nbytes = math.prod(self.block_shape) * torch.empty((), dtype=dtype).element_size()
        self.staging = Staging(prefetcher, self.block_nbytes, staging_blocks)
        self._seqs: dict[str, tuple[int, int]] = {}     # request id -> (generation, blocks held)
        self._gen = 0
        self._closed = False
        self._stats = {"swap_outs": 0, "swap_ins": 0, "bytes_out": 0, "bytes_in": 0, "seconds_out": 0.0,
                       "seconds_in": 0.0}
        # seconds_in: how long swap-ins held their consumer; on CUDA (nothing makes the host wait)
        # the stream's time through each take, from CUDA events, not the host's enqueue time
        self._in_clock = ElapsedTotal()

    @property
    def stats(self) -> dict:
        self._stats["seconds_in"] = self._in_clock.seconds
        return self._stats

    def __contains__(self, rid: str) -> bool:
        return rid in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def keys(self, rid: str, first: int = 0) -> list:
        gen, n = self._seqs[rid]
        return [(rid, gen, j) for j in range(first, n)]

    def put(self, rid: str, kv: torch.Tensor) -> None:
        """``kv``: ``[L, 2, nblk, B, nkv, hd]``, the sequence's blocks in table order."""
        t0 = time.perf_counter()
        self.drop(rid)
        self._gen += 1
        if self.transport.kind != "cuda":
            kv = kv.to("cpu")
        for j in range(kv.shape[2]):
            self.transport.put((rid, self._gen, j), kv[:, :, j])
        self._seqs[rid] = (self._gen, kv.shape[2])
        self._stats["swap_outs"] += 1
        self._stats["bytes_out"] += kv.numel() * kv.element_size()
        self._stats["seconds_out"] += time.perf_counter() - t0

    def prefetch(self, keys: list) -> int:
        n = 0
        for key in keys:
            if key[0] not in self._seqs or not self.staging.stage(key):
                break
            n += 1
        return n

    def take(self, rid: str, first: int, last: int, device) -> torch.Tensor:
        """Blocks ``[first, last)`` of ``rid``'s saved KV as ``[L, 2, (last - first) * B, nkv, hd]``
        (staged ones without waiting, the others fetched now); then everything of ``rid`` goes."""
        gen, n = self._seqs[rid]
        if not 0 <= first <= last <= n:
            raise WorkbenchError(f"SwapStore: blocks [{first}, {last}) of {rid!r}, which saved {n}")
        clock = self.transport.device if self.transport.kind == "cuda" else torch.device(device)
        with self._in_clock.region(clock):
            parts = []
            for j in range(first, last):
                raw, _ = self.staging.take((rid, gen, j), self.block_nbytes, label=f"swap {rid}#{j}")
                parts.append(raw.view(self.dtype).view(self.block_shape))
            self.drop(rid)
            L, two, B, *rest = self.block_shape
            out = (torch.cat(parts, dim=2) if parts else torch.empty(L, two, 0, *rest, dtype=self.dtype))
            out = out.to(device)
        self._stats["swap_ins"] += 1
        self._stats["bytes_in"] += len(parts) * self.block_nbytes
        return out

    def drop(self, rid: str) -> None:
        entry = self._seqs.pop(rid, None)
        if entry is None:
            return
        gen, n = entry
        for j in range(n):
            self.staging.unstage((rid, gen, j))
            self.transport.drop((rid, gen, j))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for rid in list(self._seqs):
            self.drop(rid)
        self.prefetcher.close()

    def __del__(self) -> None:   # best effort, as OffloadStore's
        try:
            if not self._closed:
                self._closed = True
                self.transport.close()
        except Exception:  # noqa: BLE001
            pass


class KVPrefetch:
    """The pool's lookahead: each engine step, stage the slower-tier KV of the next ``k`` requests
    the scheduler will admit (offloaded prefix blocks) and bring back (swapped sequences)."""

    def __init__(self, pool, k: int) -> None:
        self.pool, self.k = weakref.proxy(pool), k      # the pool owns it: no cycle keeping the pool alive
        self.owners: dict = {}                        # staged prefix block hash -> ids of requests wanting it
        self._chains: dict[str, tuple[int, list[int]]] = {}    # request id -> (tokens hashed, chain)
        self.steps = 0
        self.seconds = 0.0                            # time spent deciding and submitting

    def _chain(self, seq) -> list[int]:
        got = self._chains.get(seq.request_id)
        if got is None or got[0] != len(seq.tokens):
            got = self._chains[seq.request_id] = (len(seq.tokens),
                                                  self.pool.manager.prefix_cache.chain(seq.tokens))
        return got[1]

    def lookahead(self, scheduler, now: float) -> None:
        """``scheduler``: anything with ``lookahead(k, now) -> (waiting, swapped)`` sequences."""
        off, swap = self.pool.offload, self.pool.swap_store
        if self.k <= 0 or ((off is None or not len(off) and not off.staged_keys()) and (swap is None or not len(swap))):
            return                                     # nothing in a slower tier: nothing to stage or let go
        t0 = time.perf_counter()
        waiting, swapped = scheduler.lookahead(self.k, now)
        live = {s.request_id for s in waiting} | {s.request_id for s in swapped}
        self._chains = {rid: c for rid, c in self._chains.items() if rid in live}
        if self.pool.offload is not None:
            self._stage_prefixes(waiting)
        if self.pool.swap_store is not None:
            self._stage_swapped(swapped)
        self.steps += 1
        self.seconds += time.perf_counter() - t0

    def _stage_prefixes(self, waiting) -> None:
        store = self.pool.offload
        cap = store.staging.capacity if store.staging is not None else 0
        desired: dict[int, tuple] = {}
        owners: dict[int, set] = {}
        for seq in waiting:
            if seq.wants_prompt_logits:
                continue                               # it computes its whole prompt: nothing is restored
            for h, tokens in offloaded_prefix(self.pool, seq.tokens, self._chain(seq), evictable=True)[0]:
                if h not in desired:
                    if len(desired) >= cap:
                        break
                    desired[h] = tokens
                owners.setdefault(h, set()).add(seq.request_id)
        for key in store.staged_keys():
            if key not in desired:
                store.unstage(key)
        store.prefetch(list(desired.items()))
        self.owners = owners

    def _stage_swapped(self, swapped) -> None:
        store, B = self.pool.swap_store, self.pool.block_size
        desired: list = []
        for seq in swapped:
            if seq.request_id in store:
                first = self.pool.manager.cached_prefix_tokens(seq.tokens) // B   # the likely num_cached
                desired += store.keys(seq.request_id, first)
        desired = desired[:store.staging.capacity]
        keep = set(desired)
        for key in store.staging.staged_keys():
            if key not in keep:
                store.staging.unstage(key)
        store.prefetch(desired)

    def drop_request(self, rid: str) -> None:
        """``rid`` ended (aborted, rejected, failed): staged blocks only it wanted are let go."""
        self._chains.pop(rid, None)
        store = self.pool.offload
        for h in [h for h, who in self.owners.items() if rid in who]:
            who = self.owners[h]
            who.discard(rid)
            if not who:
                del self.owners[h]
                if store is not None:
                    store.unstage(h)

    def _parts(self) -> dict:
        pool, parts = self.pool, {}
        if pool.offload is not None and pool.offload.staging is not None:
            parts["offload"] = (pool.offload.prefetcher, pool.offload.staging)
        if pool.swap_store is not None:
            parts["swap"] = (pool.swap_store.prefetcher, pool.swap_store.staging)
        return parts

    def reset_stats(self) -> None:
        """Start the counters again (after a warm-up); staged copies stay staged."""
        for pf, st in self._parts().values():
            pf.reset_stats()
            st.uses = st.hits = st.demand = st.wasted = st.wasted_bytes = 0
            st.on_critical_s = st.hidden_s = 0.0
        self.pool.restore_seconds = self.seconds = 0.0
        self.steps = 0

    def stats(self) -> dict:
        pool, parts = self.pool, self._parts()
        out = {"lookahead": self.k, **_merge(list(parts.values())),
               "restore_wall_s": pool.restore_seconds, "lookahead_s": self.seconds, "lookahead_steps": self.steps}
        out["sources"] = {name: {"transport": pf.transport.kind, **_merge([(pf, st)])}
                          for name, (pf, st) in parts.items()}
        if pool.swap_store is not None:
            out["sources"]["swap"].update(pool.swap_store.stats)
        return out
