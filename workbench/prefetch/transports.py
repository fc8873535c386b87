"""Transports: how bytes move from a slow tier into fast memory, in the background.

A transport owns the slow tier.  ``put(key, tensor)`` stores bytes there (synchronously: this is
the offload, done once); ``start(key, dst)`` begins copying them back into ``dst`` and returns a
:class:`Job` at once; ``wait(job)`` blocks until the bytes are in ``dst``.  Three links:

* :class:`DiskTransport` - disk -> RAM, on a worker thread, into preallocated buffers.  Reads
  really come from the disk: the file is opened with ``O_DIRECT`` (aligned buffers, offsets and
  lengths, 4 KiB), so the page cache is bypassed for both writes and reads.  Where the file
  system refuses ``O_DIRECT`` (tmpfs, some overlays) it falls back to ``fdatasync`` after each
  write and ``posix_fadvise(DONTNEED)`` on the range before each read; ``read_mode`` says which.
  The machine may be a VM whose host caches below the guest: the disk's speed can vary run to run.
* :class:`HostTransport` - RAM -> RAM (``copy_`` on a worker thread): the memcpy link, a
  reference point, and what tests use.
* :class:`~workbench.prefetch.cuda_transport.CudaTransport` - pinned host -> HBM on a side CUDA
  stream.  ``start`` orders the copy after an optional event (the buffer's previous user is
  done) and records a ready event; ``wait`` makes the compute stream wait on it - no host
  synchronisation, so the whole schedule is stream operations, which a CUDA graph can capture
  (the copies become graph nodes).  Written without a GPU; checked by
  ``scripts/device_check.sh``.

A worker thread runs one job at a time in submission order (one copy lane per transport).
Torch releases the GIL inside ``copy_`` and the ``preadv`` system call does too, so the copies
overlap the model's compute on the main thread.
"""

from __future__ import annotations

import errno
import os
import queue
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from workbench.errors import ConfigError, WorkbenchError

ALIGN = 4096                 # O_DIRECT: buffer address, file offset and length multiples of this
DISK_HEADROOM = 256 << 20    # free space a disk transport leaves on the file system


def round_up(n: int, align: int = ALIGN) -> int:
    return -(-n // align) * align


def aligned_empty(nbytes: int, align: int = ALIGN) -> torch.Tensor:
    """A uint8 CPU tensor of ``round_up(nbytes)`` bytes whose address is a multiple of ``align``
    (the view keeps its larger allocation alive)."""
    n = round_up(max(nbytes, 1), align)
    raw = torch.empty(n + align, dtype=torch.uint8)
    off = (-raw.data_ptr()) % align
    return raw[off:off + n]


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """``t``'s storage as a flat uint8 tensor (contiguous tensors only)."""
    if not t.is_contiguous():
        raise WorkbenchError(f"transport: a buffer must be contiguous (got strides {t.stride()})")
    return t.reshape(-1).view(torch.uint8)


@dataclass
class Job:
    """One copy from the slow tier into ``dst``.  Host times (``time.perf_counter``) for the CPU
    transports; the CUDA transport keeps events and fills the times when they are resolved."""
    key: object
    nbytes: int
    submitted: float
    started: float | None = None
    finished: float | None = None
    error: BaseException | None = None
    done_flag: threading.Event = field(default_factory=threading.Event, repr=False)
    ready: object = field(default=None, repr=False)       # CUDA: the event recorded after the copy
    events: tuple | None = field(default=None, repr=False)  # CUDA: (start, end) timing events
    captured: bool = False                                 # CUDA: submitted while a graph was captured
    epoch: int = 0                                         # CUDA: ... during which capture

    def done(self) -> bool:
        if self.ready is not None:
            return self.captured or self.ready.query()
        return self.done_flag.is_set()

    @property
    def seconds(self) -> float | None:
        if self.started is None or self.finished is None:
            return None
        return self.finished - self.started


class Transport:
    """The interface.  Subclasses say where the slow tier is (``_store``/``_copy``)."""

    kind = "base"
    link = "?"

    def __init__(self) -> None:
        self._sizes: dict[object, int] = {}
        self.bytes_stored = 0

    def __contains__(self, key) -> bool:
        return key in self._sizes

    def nbytes_of(self, key) -> int:
        try:
            return self._sizes[key]
        except KeyError:
            raise WorkbenchError(f"{self.kind} transport: nothing stored under {key!r}") from None

    def put(self, key, data: torch.Tensor) -> None:
        """Store ``data``'s bytes under ``key`` in the slow tier (replacing what was there)."""
        data = data.detach()
        if key in self._sizes:
            self.drop(key)
        raw = as_bytes(data.contiguous())
        self._store(key, raw)
        self._sizes[key] = raw.numel()
        self.bytes_stored += raw.numel()

    def put_many(self, items) -> None:
        """``put`` of every ``(key, data)`` pair, in one batch where the transport can (the CUDA
        one: one device -> host copy into one pinned buffer instead of one per record)."""
        keys, raws = [], []
        for key, data in items:
            if key in self._sizes:
                self.drop(key)
            keys.append(key)
            raws.append(as_bytes(data.detach().contiguous()))
        if not keys:
            return
        self._store_many(keys, raws)
        for key, raw in zip(keys, raws):
            self._sizes[key] = raw.numel()
            self.bytes_stored += raw.numel()

    def _store_many(self, keys: list, raws: list) -> None:
        for key, raw in zip(keys, raws):
            self._store(key, raw)

    def drop(self, key) -> None:
        n = self._sizes.pop(key, None)
        if n is not None:
            self.bytes_stored -= n
            self._forget(key)

    def buffer(self, nbytes: int) -> torch.Tensor:
        """A destination buffer this link copies into without a bounce (uint8)."""
        return aligned_empty(nbytes)[:nbytes]

    def start(self, key, dst: torch.Tensor, after=None) -> Job:
        raise NotImplementedError

    def wait(self, job: Job) -> None:
        raise NotImplementedError

    def read(self, key, dst: torch.Tensor) -> Job:
        """Synchronous: start and wait."""
        job = self.start(key, dst)
        self.wait(job)
        return job

    def describe(self) -> dict:
        return {"transport": self.kind, "link": self.link}

    def close(self) -> None:
        pass

    # subclasses
    def _store(self, key, raw: torch.Tensor) -> None:
        raise NotImplementedError

    def _forget(self, key) -> None:
        pass


class _Worker:
    """One background thread running copy jobs in submission order."""

    def __init__(self, name: str) -> None:
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, job: Job, fn) -> None:
        self._q.put((job, fn))

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            job, fn = item
            job.started = time.perf_counter()
            try:
                # inference mode is thread-local: a destination view made under the caller's
                # inference mode may only be written in inference mode (copy_ would raise here)
                with torch.inference_mode():
                    fn()
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits for the job
                job.error = e
            job.finished = time.perf_counter()
            job.done_flag.set()

    def close(self) -> None:
        self._q.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()      # a thread still exiting when the interpreter shuts down aborts it


class _ThreadTransport(Transport):
    def __init__(self) -> None:
        super().__init__()
        self._worker = _Worker(f"workbench-{self.kind}-copy")

    def start(self, key, dst: torch.Tensor, after=None) -> Job:
        n = self.nbytes_of(key)
        out = as_bytes(dst)
        if out.numel() < n:
            raise WorkbenchError(f"{self.kind} transport: buffer of {out.numel()} bytes is too small for "
                                 f"{key!r} ({n} bytes)")
        job = Job(key, n, time.perf_counter())
        self._worker.submit(job, lambda: self._copy(key, out[:n]))
        return job

    def wait(self, job: Job) -> None:
        job.done_flag.wait()
        if job.error is not None:
            raise WorkbenchError(f"{self.kind} transport: fetching {job.key!r} failed: "
                                 f"{type(job.error).__name__}: {job.error}") from job.error

    def close(self) -> None:
        self._worker.close()

    def __del__(self) -> None:   # the worker thread ends with its transport
        try:
            self._worker.close()
        except Exception:  # noqa: BLE001
            pass

    def _copy(self, key, out: torch.Tensor) -> None:
        raise NotImplementedError


class HostTransport(_ThreadTransport):
    """RAM -> RAM: the slow tier is a set of CPU tensors; the copy is ``copy_`` on the worker."""

    kind = "host"
    link = "RAM -> RAM"

    def __init__(self) -> None:
        super().__init__()
        self._data: dict[object, torch.Tensor] = {}

    def _store(self, key, raw: torch.Tensor) -> None:
        self._data[key] = raw.to("cpu", copy=True)

    def _forget(self, key) -> None:
        self._data.pop(key, None)

    def _copy(self, key, out: torch.Tensor) -> None:
        out.copy_(self._data[key])

    def buffer(self, nbytes: int) -> torch.Tensor:
        """RAM -> RAM needs no alignment: a buffer of exactly ``nbytes``."""
        return torch.empty(nbytes, dtype=torch.uint8)


class DiskTransport(_ThreadTransport):
    """disk -> RAM: one file of 4 KiB-aligned extents, read with ``O_DIRECT`` (or, where the
    file system refuses it, ``fdatasync`` + ``posix_fadvise(DONTNEED)``).  ``path``: the file
    (default: a temporary file in ``directory``, or ``$WORKBENCH_PREFETCH_DIR``, or the system's
    temporary folder; removed by :meth:`close`).  ``direct``: None tries ``O_DIRECT`` first."""

    kind = "disk"
    link = "disk -> RAM"

    def __init__(self, path: str | os.PathLike | None = None, directory: str | os.PathLike | None = None,
                 direct: bool | None = None) -> None:
        super().__init__()
        if path is None:
            directory = directory or os.environ.get("WORKBENCH_PREFETCH_DIR") or tempfile.gettempdir()
            fd, path = tempfile.mkstemp(prefix="workbench-prefetch-", suffix=".bin", dir=directory)
            os.close(fd)
            self._owns = True
        else:
            self._owns = False
        self.path = Path(path)
        self.fd, self.read_mode = self._open(direct)
        self._extents: dict[object, tuple[int, int]] = {}     # key -> (offset, rounded length)
        self._free: list[tuple[int, int]] = []                 # freed extents (offset, length)
        self._end = 0

    def _open(self, direct: bool | None) -> tuple[int, str]:
        flags = os.O_RDWR | os.O_CREAT
        if direct is not False and hasattr(os, "O_DIRECT"):
            try:
                return os.open(self.path, flags | os.O_DIRECT, 0o600), "O_DIRECT"
            except OSError as e:
                if direct or e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise ConfigError(f"DiskTransport: cannot open {self.path} with O_DIRECT: {e}") from e
        if not hasattr(os, "posix_fadvise"):
            raise ConfigError("DiskTransport: this system has neither O_DIRECT nor posix_fadvise; reads would "
                              "come from the page cache, not the disk")
        return os.open(self.path, flags, 0o600), "fadvise(DONTNEED)"

    def describe(self) -> dict:
        return {**super().describe(), "read_mode": self.read_mode, "path": str(self.path)}

    def _extent(self, length: int) -> int:
        for i, (off, n) in enumerate(self._free):
            if n >= length:
                self._free.pop(i)
                if n > length:
                    self._free.append((off + length, n - length))
                return off
        free = shutil.disk_usage(self.path.parent).free
        if free < length + DISK_HEADROOM:
            raise ConfigError(
                f"DiskTransport: {self.path.parent} has {free / 2**30:.2f} GiB free; writing "
                f"{length / 2**20:.1f} MiB more would leave less than {DISK_HEADROOM >> 20} MiB. Free some space "
                "or point WORKBENCH_PREFETCH_DIR (or directory=) at a larger file system")
        off, self._end = self._end, self._end + length
        return off

    def _store(self, key, raw: torch.Tensor) -> None:
        length = round_up(raw.numel())
        off = self._extent(length)
        if self.read_mode == "O_DIRECT":
            bounce = aligned_empty(length)
            bounce[:raw.numel()].copy_(raw)
            self._pwrite(bounce, off)
        else:
            self._pwrite(raw.contiguous(), off)
            os.fdatasync(self.fd)                         # dirty pages cannot be dropped: write them first
            os.posix_fadvise(self.fd, off, length, os.POSIX_FADV_DONTNEED)
        self._extents[key] = (off, length)

    def _pwrite(self, buf: torch.Tensor, off: int) -> None:
        view = memoryview(buf.numpy())
        done = 0
        while done < len(view):
            done += os.pwrite(self.fd, view[done:], off + done)

    def _forget(self, key) -> None:
        ext = self._extents.pop(key, None)
        if ext is not None:
            self._free.append(ext)

    def _copy(self, key, out: torch.Tensor) -> None:
        off, length = self._extents[key]
        n = out.numel()
        if self.read_mode == "O_DIRECT":
            if out.data_ptr() % ALIGN == 0 and _capacity(out) >= length:
                target = torch.as_strided(out, (length,), (1,))   # the buffer's rounded tail is ours
                self._pread(target, off)
            else:                                                  # an unaligned buffer: through a bounce
                bounce = aligned_empty(length)
                self._pread(bounce, off)
                out.copy_(bounce[:n])
        else:
            os.posix_fadvise(self.fd, off, length, os.POSIX_FADV_DONTNEED)   # the disk, not the page cache
            self._pread(out, off)

    def _pread(self, buf: torch.Tensor, off: int) -> None:
        view = memoryview(buf.numpy())
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], off + done)
            if got <= 0:
                raise WorkbenchError(f"DiskTransport: short read at offset {off + done} of {self.path}")
            done += got

    def buffer(self, nbytes: int) -> torch.Tensor:
        return aligned_empty(nbytes)[:nbytes]

    def close(self) -> None:
        super().close()
        try:
            os.close(self.fd)
        except OSError:
            pass
        if self._owns:
            self.path.unlink(missing_ok=True)

    def __del__(self) -> None:   # best effort: a temporary file does not outlive its transport
        super().__del__()
        try:
            if self._owns and self.path.exists():
                self.path.unlink()
        except Exception:  # noqa: BLE001
            pass


def _capacity(t: torch.Tensor) -> int:
    """Bytes from ``t``'s first element to the end of its storage."""
    st = t.untyped_storage()
    return st.nbytes() - (t.data_ptr() - st.data_ptr())


def make_transport(kind: str = "auto", device=None, **kw) -> Transport:
    """``"disk"``, ``"host"``, ``"cuda"`` or ``"auto"`` (cuda for a CUDA device, else disk)."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if kind == "auto":
        kind = "cuda" if dev.type == "cuda" else "disk"
    if kind == "disk":
        return DiskTransport(**kw)
    if kind == "host":
        return HostTransport()
    if kind == "cuda":
        # lazy: cuda_transport imports this module (a cycle); tests swap cuda_transport.CudaTransport
        from workbench.prefetch.cuda_transport import CudaTransport

        kw.pop("path", None)        # a disk file means nothing for pinned host memory (WeightStreamConfig.path)
        kw.pop("directory", None)
        return CudaTransport(dev, **kw)
    raise ConfigError(f"transport must be 'auto', 'disk', 'host' or 'cuda', got {kind!r}")
