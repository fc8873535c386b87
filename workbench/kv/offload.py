"""Offload tier: KV blocks spilled from the pool to host memory or to a file on disk.

When the prefix cache must evict a cached block to make room, the pool first copies the
block's KV (every layer, K and V) here, keyed by the block's chain hash; when a later prompt's
prefix chain reaches that hash again, the block is copied back instead of recomputed.  Every
copy is timed and its bytes counted, so the notebook can weigh "recompute the prefix" against
"fetch it from a slower tier".

Two stores share one interface (:class:`OffloadStore`), each over a transport of the prefetch
layer (:mod:`workbench.prefetch.transports`), which owns the bytes:

* :class:`HostOffload` — CPU memory (RAM -> RAM copies on a worker thread); with a CUDA pool,
  pinned host memory copied into device buffers on a side stream;
* :class:`DiskOffload` — one file of 4 KiB-aligned extents, written and read with ``O_DIRECT``
  (or ``fdatasync`` + ``posix_fadvise(DONTNEED)`` where the file system refuses it): reads
  really come from the disk, not from the page cache (``transport.read_mode`` says which).

Both hold at most ``capacity_blocks`` blocks and drop the least recently used one beyond that.
Stored content is verified by the block's tokens on every read, like the prefix cache itself.

Reads go through a :class:`~workbench.prefetch.prefetcher.Prefetcher`.  With staging buffers
(``staging_blocks``), :meth:`OffloadStore.prefetch` starts copies of blocks a lookahead
predicts (:mod:`workbench.kv.kv_prefetch`) and :meth:`OffloadStore.get` uses a staged copy when
there is one (a prefetch hit); otherwise it fetches now and waits (a demand fetch).  A staged
copy of a block the tier drops (or replaces) is never used.
"""

from __future__ import annotations

import math
import os
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass

import torch

from workbench.errors import ConfigError, WorkbenchError
from workbench.measure.timing import ElapsedTotal
from workbench.prefetch.prefetcher import Prefetcher
from workbench.prefetch.cuda_transport import CudaTransport
from workbench.prefetch.transports import DiskTransport, HostTransport, Transport


@dataclass
class OffloadStats:
    puts: int = 0
    gets: int = 0            # successful reads (blocks restored)
    misses: int = 0          # reads of a key not held (or held with other tokens)
    evictions: int = 0       # blocks dropped from the tier itself (capacity)
    already_held: int = 0    # puts of a block the tier held with the same tokens (nothing written)
    prefetch_hits: int = 0   # gets served from a staged copy that had landed
    bytes_out: int = 0       # pool -> tier
    bytes_in: int = 0        # tier -> pool
    seconds_out: float = 0.0
    seconds_in: float = 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["gb_per_s_out"] = self.bytes_out / self.seconds_out / 1e9 if self.seconds_out else None
        d["gb_per_s_in"] = self.bytes_in / self.seconds_in / 1e9 if self.seconds_in else None
        return d


class Staging:
    """``capacity`` buffers of ``nbytes`` over ``prefetcher``: ``stage(key)`` starts a copy into a
    free buffer (False when none is free), ``take(key)`` hands the bytes over at the moment of
    use, ``unstage(key)`` lets a staged copy go (its buffer is reused once the copy has landed)."""

    def __init__(self, prefetcher: Prefetcher, nbytes: int, capacity: int) -> None:
        if capacity < 0:
            raise WorkbenchError(f"Staging: capacity must be >= 0, got {capacity}")
        self.pf, self.nbytes, self.capacity = prefetcher, nbytes, capacity
        self._free = [prefetcher.transport.buffer(nbytes) for _ in range(capacity)]
        self._staged: dict = {}                 # key -> buffer (submitted, not used yet)
        self._retiring: list[tuple] = []        # (job, buffer): let go while the copy was in flight
        self.uses = self.hits = self.demand = 0
        self.on_critical_s = self.hidden_s = 0.0
        self.wasted = self.wasted_bytes = 0     # staged copies never used

    def __contains__(self, key) -> bool:
        return key in self._staged

    def staged_keys(self) -> list:
        return list(self._staged)

    @property
    def num_free(self) -> int:
        self._reclaim()
        return len(self._free)

    def _reclaim(self) -> None:
        if self._retiring:
            self._free += [buf for job, buf in self._retiring if job.done()]
            self._retiring = [(job, buf) for job, buf in self._retiring if not job.done()]

    def stage(self, key) -> bool:
        if key in self._staged:
            return True
        self._reclaim()
        if not self._free:
            return False
        buf = self._free.pop()
        self.pf.submit(key, buf)
        self._staged[key] = buf
        return True

    def unstage(self, key) -> None:
        buf = self._staged.pop(key, None)
        if buf is None:
            return
        job = self.pf.pending.pop(key, None)
        self.wasted += 1
        self.wasted_bytes += job.nbytes if job is not None else 0
        if job is None or job.done():
            self._free.append(buf)
        else:
            self._retiring.append((job, buf))

    def clear(self) -> None:
        for key in list(self._staged):
            self.unstage(key)

    def take(self, key, nbytes: int, label: str | None = None) -> tuple[torch.Tensor, bool]:
        """``key``'s bytes (a uint8 tensor of ``nbytes`` the caller now owns) and whether they
        were in place already (a prefetch hit).  Not staged: a demand fetch, waited for."""
        tr = self.pf.transport
        buf = self._staged.pop(key, None)
        staged = buf is not None
        if staged:
            self._free.append(tr.buffer(self.nbytes))      # the set keeps its size
        else:
            buf = tr.buffer(max(nbytes, self.nbytes))
        job = self.pf.pending.get(key)
        hit = staged and job is not None and job.done()
        t0 = time.perf_counter()
        job = self.pf.wait(key, buf, label)
        stall = time.perf_counter() - t0
        self.uses += 1
        self.hits += hit
        self.demand += not staged
        if tr.kind != "cuda":       # CUDA: the host does not wait; the prefetcher's events say it
            self.on_critical_s += stall
            self.hidden_s += max(0.0, (job.seconds or 0.0) - stall)
        return buf[:nbytes], hit

    def close(self) -> None:
        self.clear()
        self._retiring.clear()
        self._free.clear()


class OffloadStore:
    """Base: ``put(key, tokens, kv)``, ``get(key, tokens, device) -> kv | None``; kv is one block,
    ``[num_layers, 2, block_size, num_kv_heads, head_dim]``.  ``transport`` holds the bytes;
    ``prefetcher``: an optional :class:`Prefetcher` over it (default: one made here);
    ``staging_blocks``: block buffers :meth:`prefetch` may fill ahead (0: every read is a demand
    fetch).  ``block_shape`` / ``dtype``: known up front, or taken from the first put."""

    kind = "base"

    def __init__(self, capacity_blocks: int, transport: Transport | None = None, prefetcher: Prefetcher | None = None,
                 block_shape: tuple[int, ...] | None = None, dtype: torch.dtype | None = None,
                 staging_blocks: int = 0) -> None:
        if capacity_blocks < 1:
            raise ConfigError(f"{type(self).__name__}.capacity_blocks must be >= 1, got {capacity_blocks}")
        if staging_blocks < 0:
            raise ConfigError(f"{type(self).__name__}.staging_blocks must be >= 0, got {staging_blocks}")
        owns = prefetcher is None
        if prefetcher is None:
            if transport is None:
                raise ConfigError(f"{type(self).__name__}: give a transport or a prefetcher")
            prefetcher = Prefetcher(transport, name=f"kv-offload-{self.kind}")
        elif transport is not None and transport is not prefetcher.transport:
            raise ConfigError(f"{type(self).__name__}: the prefetcher must fetch over the store's transport")
        self.capacity_blocks, self.staging_blocks = capacity_blocks, staging_blocks
        self.prefetcher, self.transport = prefetcher, prefetcher.transport
        self._owns_transport = owns          # a prefetcher the caller gave is closed by the caller
        self._closed = False
        self._stats = OffloadStats()
        # seconds_in: how long restores held their consumer.  A CUDA pool (or transport) does not
        # make the host wait (copies are enqueued, the compute stream waits on them), so there it
        # is the stream's time through each restore, from CUDA events, not the host's enqueue time
        self._in_clock = ElapsedTotal()
        self._index: OrderedDict[int, tuple] = OrderedDict()   # key -> block tokens, LRU order
        self.block_shape = self.dtype = None
        self.block_nbytes = 0
        self.staging: Staging | None = None
        if block_shape is not None:
            self._set_block(tuple(block_shape), dtype)

    def _set_block(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if dtype is None:
            raise ConfigError(f"{type(self).__name__}: block_shape needs a dtype")
        self.block_shape, self.dtype = shape, dtype
        self.block_nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        self.staging = Staging(self.prefetcher, self.block_nbytes, self.staging_blocks)

    @property
    def stats(self) -> OffloadStats:
        """The counters (``seconds_in`` resolved from the device's events when read)."""
        self._stats.seconds_in = self._in_clock.seconds
        return self._stats

    def _clock_device(self, device) -> torch.device:
        return self.transport.device if self.transport.kind == "cuda" else torch.device(device)

    def __contains__(self, key: int) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def holds(self, key: int, tokens: tuple) -> bool:
        return self._index.get(key) == tuple(tokens)

    def keep(self, key: int, tokens: tuple) -> bool:
        """Held with these tokens already (the same block: chain hash and tokens)?  Then it counts
        as just written (most recently used) and nothing needs writing."""
        if self._index.get(key) != tuple(tokens):
            return False
        self._index.move_to_end(key)
        self._stats.already_held += 1
        return True

    def put(self, key: int, tokens: tuple, kv: torch.Tensor) -> None:
        t0 = time.perf_counter()
        tokens = tuple(tokens)
        if self.keep(key, tokens):
            return
        if self.block_shape is None:
            self._set_block(tuple(kv.shape), kv.dtype)
        elif tuple(kv.shape) != self.block_shape or kv.dtype != self.dtype:
            raise WorkbenchError(f"{type(self).__name__}.put: block {tuple(kv.shape)} {kv.dtype}, the tier holds "
                                 f"{self.block_shape} {self.dtype}")
        if key in self._index:
            self._drop(key)
        while len(self._index) >= self.capacity_blocks:
            self._drop(next(iter(self._index)))
            self._stats.evictions += 1
        self.transport.put(key, kv if self.transport.kind == "cuda" else kv.detach().to("cpu"))
        self._index[key] = tokens
        self._stats.puts += 1
        self._stats.bytes_out += self.block_nbytes
        self._stats.seconds_out += time.perf_counter() - t0     # synchronous: a CUDA put copies to pinned memory

    def get(self, key: int, tokens: tuple, device: torch.device) -> torch.Tensor | None:
        """The block's KV on ``device`` (a tensor the caller owns), or None (a miss: not held, or
        held for other tokens).  From a staged copy when :meth:`prefetch` started one, else
        fetched now (the caller waits for it)."""
        if self._index.get(key) != tuple(tokens):
            self._stats.misses += 1
            return None
        with self._in_clock.region(self._clock_device(device)):
            self._index.move_to_end(key)
            raw, hit = self.staging.take(key, self.block_nbytes, label=f"kv {key:#x}")
            kv = raw.view(self.dtype).view(self.block_shape).to(device)
        self._stats.gets += 1
        self._stats.prefetch_hits += hit
        self._stats.bytes_in += self.block_nbytes
        return kv

    def prefetch(self, items) -> int:
        """Start copying blocks that will be read soon: ``items`` are ``(key, tokens)`` pairs in
        order of need.  Blocks not held (or held for other tokens) are skipped; staging stops at
        the first block no buffer is free for.  Returns how many are staged (new or already)."""
        if self.staging is None:
            return 0
        n = 0
        for key, tokens in items:
            if self._index.get(key) != tuple(tokens):
                continue
            if not self.staging.stage(key):
                break
            n += 1
        return n

    def staged_keys(self) -> list[int]:
        return self.staging.staged_keys() if self.staging is not None else []

    def unstage(self, key: int) -> None:
        if self.staging is not None:
            self.staging.unstage(key)

    def nbytes(self) -> int:
        return self.transport.bytes_stored

    def forget(self) -> None:
        """Drop every block (the tier starts empty again; its buffers and counters stay)."""
        for key in list(self._index):
            self._drop(key)

    def _drop(self, key: int) -> None:
        self._index.pop(key)
        self.unstage(key)                 # a copy in flight may read bytes about to be replaced
        self.transport.drop(key)

    def close(self) -> None:
        """Let staged copies finish and give back the tier (a disk tier's temporary file goes)."""
        if self._closed:
            return
        self._closed = True
        if self.staging is not None:
            self.staging.clear()
        if self._owns_transport:
            self.prefetcher.close()
        else:
            self.prefetcher.drain()

    def __del__(self) -> None:   # best effort: the worker thread, file descriptor and temporary file go too
        try:
            if getattr(self, "_owns_transport", False) and not self._closed:
                self._closed = True
                self.transport.close()
        except Exception:  # noqa: BLE001
            pass


class HostOffload(OffloadStore):
    """Blocks in CPU memory.  With a CUDA pool (``device``, or ``pin`` when no device is given)
    the blocks are pinned and copied into device buffers on a side stream; else RAM -> RAM."""

    kind = "host"

    def __init__(self, capacity_blocks: int, pin: bool | None = None, block_shape: tuple[int, ...] | None = None,
                 dtype: torch.dtype | None = None, device=None, prefetcher: Prefetcher | None = None,
                 staging_blocks: int = 0) -> None:
        if device is not None:
            cuda = torch.device(device).type == "cuda"
        else:
            cuda = torch.cuda.is_available() if pin is None else bool(pin)
        self.pin = cuda
        transport = None
        if prefetcher is None:
            transport = CudaTransport(device if device is not None else "cuda") if cuda else HostTransport()
        super().__init__(capacity_blocks, transport, prefetcher, block_shape, dtype, staging_blocks)


class DiskOffload(OffloadStore):
    """Blocks in one file through a :class:`~workbench.prefetch.transports.DiskTransport`:
    ``O_DIRECT`` reads and writes, so every read hits the disk (no page cache in between).
    ``path``: the file (default: a temporary one, removed by :meth:`close`)."""

    kind = "disk"

    def __init__(self, capacity_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 path: str | os.PathLike | None = None, prefetcher: Prefetcher | None = None,
                 staging_blocks: int = 0) -> None:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ConfigError(f"DiskOffload: dtype {dtype} is not supported (float32, float16, bfloat16)")
        transport = DiskTransport(path=path) if prefetcher is None else None
        if prefetcher is not None and prefetcher.transport.kind != "disk":
            raise ConfigError(f"DiskOffload: the prefetcher fetches over a {prefetcher.transport.kind} transport, "
                              "not a disk one")
        super().__init__(capacity_blocks, transport, prefetcher, block_shape, dtype, staging_blocks)

    @property
    def path(self):
        return self.transport.path
