"""Offload tier: KV blocks spilled from the pool to host memory or to a file on disk.

When the prefix cache must evict a cached block to make room, the pool first copies the
block's KV (every layer, K and V) here, keyed by the block's chain hash; when a later prompt's
prefix chain reaches that hash again, the block is copied back instead of recomputed.  Every
copy is timed and its bytes counted, so the notebook can weigh "recompute the prefix" against
"fetch it from a slower tier".

Two stores share one interface (:class:`OffloadStore`):

* :class:`HostOffload` — CPU tensors (pinned when the pool lives on a GPU, so copies can be
  asynchronous later);
* :class:`DiskOffload` — one preallocated file of fixed-size slots, read and written through a
  memory map (the operating system's page cache sits in between, as it would in production).

Both hold at most ``capacity_blocks`` blocks and drop the least recently used one beyond that.
Stored content is verified by the block's tokens on every read, like the prefix cache itself.
The prefetch layer plugs in through :meth:`OffloadStore.prefetch` (here: a no-op hint).
"""

from __future__ import annotations

import os
import tempfile
import time
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from workbench.errors import ConfigError


@dataclass
class OffloadStats:
    puts: int = 0
    gets: int = 0            # successful reads (blocks restored)
    misses: int = 0          # reads of a key not held (or held with other tokens)
    evictions: int = 0       # blocks dropped from the tier itself (capacity)
    bytes_out: int = 0       # pool -> tier
    bytes_in: int = 0        # tier -> pool
    seconds_out: float = 0.0
    seconds_in: float = 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["gb_per_s_out"] = self.bytes_out / self.seconds_out / 1e9 if self.seconds_out else None
        d["gb_per_s_in"] = self.bytes_in / self.seconds_in / 1e9 if self.seconds_in else None
        return d


class OffloadStore:
    """Base: ``put(key, tokens, kv)``, ``get(key, tokens) -> kv | None``; kv is one block,
    ``[num_layers, 2, block_size, num_kv_heads, head_dim]``."""

    kind = "base"

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ConfigError(f"{type(self).__name__}.capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.stats = OffloadStats()
        self._index: OrderedDict[int, tuple] = OrderedDict()   # key -> (tokens, slot/tensor), LRU order

    def __contains__(self, key: int) -> bool:
        return key in self._index

    def __len__(self) -> int:
        return len(self._index)

    def holds(self, key: int, tokens: tuple) -> bool:
        entry = self._index.get(key)
        return entry is not None and entry[0] == tokens

    def put(self, key: int, tokens: tuple, kv: torch.Tensor) -> None:
        t0 = time.perf_counter()
        if key in self._index:
            self._drop(key)
        while len(self._index) >= self.capacity_blocks:
            old, _ = next(iter(self._index.items()))
            self._drop(old)
            self.stats.evictions += 1
        self._index[key] = (tuple(tokens), self._write(kv))
        self.stats.puts += 1
        self.stats.bytes_out += kv.numel() * kv.element_size()
        self.stats.seconds_out += time.perf_counter() - t0

    def get(self, key: int, tokens: tuple, device: torch.device) -> torch.Tensor | None:
        entry = self._index.get(key)
        if entry is None or entry[0] != tuple(tokens):
            self.stats.misses += 1
            return None
        t0 = time.perf_counter()
        self._index.move_to_end(key)
        kv = self._read(entry[1]).to(device, non_blocking=False)
        if kv.device.type == "cuda":
            torch.cuda.synchronize(kv.device)
        self.stats.gets += 1
        self.stats.bytes_in += kv.numel() * kv.element_size()
        self.stats.seconds_in += time.perf_counter() - t0
        return kv

    def prefetch(self, keys: list[int]) -> None:
        """Hint that these blocks will be read soon (the prefetch engine overrides this)."""

    def nbytes(self) -> int:
        raise NotImplementedError

    # subclasses: where the bytes live
    def _write(self, kv: torch.Tensor):
        raise NotImplementedError

    def _read(self, handle) -> torch.Tensor:
        raise NotImplementedError

    def _drop(self, key: int) -> None:
        self._index.pop(key)


class HostOffload(OffloadStore):
    """Blocks as CPU tensors; pinned (page-locked) when the pool is on CUDA."""

    kind = "host"

    def __init__(self, capacity_blocks: int, pin: bool | None = None) -> None:
        super().__init__(capacity_blocks)
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._bytes = 0

    def _write(self, kv: torch.Tensor) -> torch.Tensor:
        host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=self.pin)
        host.copy_(kv)
        self._bytes += host.numel() * host.element_size()
        return host

    def _read(self, handle: torch.Tensor) -> torch.Tensor:
        return handle

    def _drop(self, key: int) -> None:
        _, host = self._index.pop(key)
        self._bytes -= host.numel() * host.element_size()

    def nbytes(self) -> int:
        return self._bytes


class DiskOffload(OffloadStore):
    """Blocks in fixed-size slots of one file, through a memory map."""

    kind = "disk"

    def __init__(self, capacity_blocks: int, block_shape: tuple[int, ...], dtype: torch.dtype,
                 path: str | os.PathLike | None = None) -> None:
        super().__init__(capacity_blocks)
        self.block_shape, self.dtype = tuple(block_shape), dtype
        np_dtype = {torch.float32: np.float32, torch.float16: np.float16, torch.bfloat16: np.uint16}.get(dtype)
        if np_dtype is None:
            raise ConfigError(f"DiskOffload: dtype {dtype} is not supported (float32, float16, bfloat16)")
        self._np_dtype = np_dtype
        if path is None:
            fd, path = tempfile.mkstemp(prefix="workbench-kv-", suffix=".bin")
            os.close(fd)
            self._owns_file = True
        else:
            self._owns_file = False
        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np_dtype, mode="w+", shape=(capacity_blocks, *self.block_shape))
        self._free = list(range(capacity_blocks - 1, -1, -1))

    def _write(self, kv: torch.Tensor) -> int:
        slot = self._free.pop()
        data = kv.detach().to("cpu").contiguous()
        if self.dtype == torch.bfloat16:
            data = data.view(torch.int16)        # numpy has no bfloat16: store the raw bits
        self._map[slot] = data.numpy()
        return slot

    def _read(self, slot: int) -> torch.Tensor:
        arr = torch.from_numpy(np.array(self._map[slot]))
        return arr.view(torch.bfloat16) if self.dtype == torch.bfloat16 else arr

    def _drop(self, key: int) -> None:
        _, slot = self._index.pop(key)
        self._free.append(slot)

    def nbytes(self) -> int:
        return len(self._index) * int(np.prod(self.block_shape)) * np.dtype(self._np_dtype).itemsize

    def close(self) -> None:
        del self._map
        if self._owns_file:
            self.path.unlink(missing_ok=True)

    def __del__(self) -> None:  # best effort: temporary files do not outlive the store
        try:
            if self._owns_file and self.path.exists():
                self.path.unlink()
        except Exception:  # noqa: BLE001
            pass
