"""Each link's ceiling, measured per block size: what a transport moves per second when its copy
lane is kept busy, and what one block costs when fetched alone.

::

    pts = measure_link("disk")                  # 8 KiB .. 4 MiB blocks, 64 MiB per size, 3 repeats
    ceiling(pts)                                # the best median GB/s: the prefetcher's link_use denominator
    [asdict(p) for p in pts]                    # a table's rows

Per block size: N blocks (``total_bytes / size``, at most ``max_blocks``, at least 4) go into
the transport's slow tier once (for ``disk``: a fresh temporary file, written with ``O_DIRECT``
or ``fdatasync`` + ``fadvise(DONTNEED)``, removed after that size), then each repeat

* **queued**: submits all N fetches at once (round-robin over 4 destination buffers; one lane
  runs them in order, so it never idles) and waits for the last: GB/s = N * size / the lane's
  time from the first copy's start to the last copy's end (the worker's clock on CPU links,
  CUDA events on ``cuda``) - the same clock the prefetcher's ``achieved_gbps`` uses, so
  ``link_use`` compares like with like;
* **one at a time**: fetches up to ``latency_blocks`` blocks, each waited for before the next:
  the median microseconds per block.  On CPU links that is the host's time from the request to
  the bytes in place (the cost a demand fetch pays); on ``cuda`` it is the copy's own event time,
  which leaves out the enqueue and the wait.  ``us_per_block_host`` is the host's time on every
  link (request to ``synchronize`` on CUDA), the column to compare links by.

Disk space: at most ``total_bytes`` (plus the 256 MiB headroom the disk transport keeps free) is
on disk at once; the default is a modest 64 MiB, and a file system without room raises
ConfigError before anything is written.  Which disk is measured: ``directory`` (default
``$WORKBENCH_PREFETCH_DIR`` or the system's temporary folder), the same place weight streaming
puts its file by default.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

from workbench.errors import ConfigError
from workbench.prefetch.cuda_transport import CudaTransport
from workbench.prefetch.transports import DISK_HEADROOM, DiskTransport, HostTransport, round_up

KiB, MiB = 1 << 10, 1 << 20
DEFAULT_SIZES = tuple(8 * KiB << i for i in range(10))    # 8 KiB, 16 KiB, ..., 4 MiB
DEFAULT_TOTAL = 64 * MiB
QUEUE_BUFFERS = 4


@dataclass
class LinkPoint:
    """One block size on one link.  ``gbps_*``: queued fetches (the lane kept busy), over
    ``repeats`` passes of ``blocks`` blocks; ``us_per_block``: median latency of a block fetched
    alone (CUDA: the copy's own events); ``sync_gbps``: the bandwidth that latency implies
    (block_bytes / us_per_block); ``us_per_block_host``: the host's median time for that fetch,
    request to bytes in place (the same clock on every link)."""
    transport: str
    link: str
    read_mode: str | None
    block_bytes: int
    gbps_median: float
    gbps_min: float
    gbps_max: float
    us_per_block: float
    repeats: int
    blocks: int = 0
    sync_gbps: float = 0.0
    us_per_block_host: float = 0.0


def _check_args(transport_kind: str, sizes, total_bytes: int, repeats: int) -> None:
    if transport_kind not in ("disk", "host", "cuda"):
        raise ConfigError(f"measure_link: transport_kind must be 'disk', 'host' or 'cuda', got {transport_kind!r}")
    if not sizes or any(not isinstance(s, int) or s <= 0 for s in sizes):
        raise ConfigError(f"measure_link: sizes must be positive integers (bytes), got {sizes!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ConfigError(f"measure_link: repeats must be an integer >= 1, got {repeats!r}")
    if total_bytes < max(sizes):
        raise ConfigError(f"measure_link: total_bytes={total_bytes} is smaller than the largest block ({max(sizes)})")
    if transport_kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("measure_link('cuda') needs a CUDA device (this machine has none); measure 'disk' or "
                          "'host' on a CPU")


def _check_disk(directory: str, sizes, total_bytes: int, max_blocks: int) -> None:
    """Fail before writing: the largest per-size footprint must fit with the headroom left."""
    need = max(round_up(s) * _num_blocks(s, total_bytes, max_blocks) for s in sizes)
    free = shutil.disk_usage(directory).free
    if free < need + DISK_HEADROOM:
        raise ConfigError(f"measure_link: {directory} has {free / 2**30:.2f} GiB free; the benchmark writes up to "
                          f"{need / MiB:.0f} MiB at once and leaves {DISK_HEADROOM >> 20} MiB free. Lower total_bytes "
                          "or point WORKBENCH_PREFETCH_DIR (or directory=) at a larger file system")


def _num_blocks(size: int, total_bytes: int, max_blocks: int) -> int:
    return max(4, min(total_bytes // size, max_blocks))


def _make(kind: str, device, directory: str | None, direct: bool | None):
    if kind == "disk":
        return DiskTransport(directory=directory, direct=direct)
    if kind == "host":
        return HostTransport()
    return CudaTransport(device, timing=True)


def _queued_seconds(tr, n: int, bufs: list) -> float:
    """Submit all n fetches, wait for the last; the elapsed seconds of the lane's work."""
    if tr.kind == "cuda":
        torch.cuda.synchronize(tr.device)
        jobs = [tr.start(k, bufs[k % len(bufs)], after=None) for k in range(n)]
        jobs[-1].ready.synchronize()
        return jobs[0].events[0].elapsed_time(jobs[-1].events[1]) / 1e3
    jobs = [tr.start(k, bufs[k % len(bufs)]) for k in range(n)]
    for j in jobs:
        tr.wait(j)
    return jobs[-1].finished - jobs[0].started


def _one_seconds(tr, key, buf) -> tuple[float, float]:
    """One fetch, waited for before returning: ``(link seconds, host seconds)``.  The link's are
    the copy's own events on CUDA, the host's otherwise; the host's run from the request to the
    bytes in place (CUDA: enqueue + ``synchronize`` of the copy's ready event)."""
    if tr.kind == "cuda":
        torch.cuda.synchronize(tr.device)              # nothing queued ahead of this one
        t0 = time.perf_counter()
        job = tr.start(key, buf, after=None)
        job.ready.synchronize()
        host = time.perf_counter() - t0
        return job.events[0].elapsed_time(job.events[1]) / 1e3, host
    t0 = time.perf_counter()
    tr.read(key, buf)
    host = time.perf_counter() - t0
    return host, host


def measure_link(transport_kind: str = "disk", sizes=DEFAULT_SIZES, total_bytes: int = DEFAULT_TOTAL,
                 repeats: int = 3, device=None, directory: str | os.PathLike | None = None,
                 max_blocks: int = 2048, latency_blocks: int = 32, direct: bool | None = None) -> list[LinkPoint]:
    """Measure ``transport_kind`` ("disk", "host" or "cuda") at each block size in ``sizes``
    (bytes).  ``total_bytes`` (default 64 MiB) of blocks per size, capped at ``max_blocks``
    blocks so the smallest sizes stay quick; ``repeats`` queued passes per size (median and
    spread); ``latency_blocks`` blocks fetched one at a time per repeat.  ``device``: the CUDA
    device (``cuda`` only).  ``directory`` / ``direct``: the disk transport's place and mode
    (``direct=False``: ``fadvise`` instead of ``O_DIRECT``)."""
    sizes = tuple(sorted(sizes))
    _check_args(transport_kind, sizes, total_bytes, repeats)
    if transport_kind == "disk":
        directory = str(directory or os.environ.get("WORKBENCH_PREFETCH_DIR") or tempfile.gettempdir())
        _check_disk(directory, sizes, total_bytes, max_blocks)
    points = []
    for size in sizes:
        n = _num_blocks(size, total_bytes, max_blocks)
        tr = _make(transport_kind, device, directory, direct)
        try:
            points.append(_measure_size(tr, size, n, repeats, latency_blocks))
        finally:
            tr.close()
    return points


def _measure_size(tr, size: int, n: int, repeats: int, latency_blocks: int) -> LinkPoint:
    block = torch.arange(size, dtype=torch.int64).to(torch.uint8)     # a pattern, not zeros
    for k in range(n):
        tr.put(k, block)
    bufs = [tr.buffer(size) for _ in range(QUEUE_BUFFERS)]
    _queued_seconds(tr, min(n, 8), bufs)                               # warm-up: threads, buffers, first touch
    if not torch.equal(bufs[0][:size].cpu(), block):
        raise ConfigError(f"measure_link: {tr.kind} link returned wrong bytes at block size {size}")
    gbps, lat, lat_host = [], [], []
    for r in range(repeats):
        gbps.append(n * size / _queued_seconds(tr, n, bufs) / 1e9)
        for i in range(min(n, latency_blocks)):
            link_s, host_s = _one_seconds(tr, (r * latency_blocks + i) % n, bufs[0])
            lat.append(link_s)
            lat_host.append(host_s)
    us = statistics.median(lat) * 1e6
    d = tr.describe()
    return LinkPoint(transport=tr.kind, link=tr.link, read_mode=d.get("read_mode"), block_bytes=size,
                     gbps_median=statistics.median(gbps), gbps_min=min(gbps), gbps_max=max(gbps),
                     us_per_block=us, repeats=repeats, blocks=n, sync_gbps=size / us / 1e3,
                     us_per_block_host=statistics.median(lat_host) * 1e6)


def ceiling(points) -> float | None:
    """The best median GB/s among ``points`` (None when there are none): the measured ceiling of
    a link, what ``Prefetcher(ceiling_gbps=...)`` divides achieved bandwidth by."""
    vals = [p.gbps_median for p in points]
    return max(vals) if vals else None


__all__ = ["LinkPoint", "measure_link", "ceiling", "DEFAULT_SIZES", "DEFAULT_TOTAL"]
