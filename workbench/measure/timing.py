"""Timing work that may run on a GPU: one helper for every benchmark.

On a CPU an op has finished when the Python call returns, so ``time.perf_counter()`` around the
call is the op's time.  On a CUDA device a call only *enqueues* kernels and copies on a stream
and returns at once (a graph replay, a ``non_blocking`` copy, an eager matmul: all asynchronous).
A host clock read right after such a call measures the launch, not the work: a 5 ms decode step
reads as 0.05 ms, a 1 GB copy as "200 TB/s", and the work is charged to whatever happens to
synchronize next (the sampler's ``.tolist()``, the next bench row).  Host clocks without a
synchronization are therefore wrong on a GPU, and they are wrong silently.

Two correct ways, and when each is used here:

* **CUDA events** (``events=True``, the default on CUDA): ``torch.cuda.Event(enable_timing=True)``
  recorded on the device's current stream before and after the work.  The GPU stamps each event
  when the stream reaches it, so ``start.elapsed_time(end)`` is the stream's time between the two
  points: the device time of the work (plus any gaps in which the GPU waited for the host to
  launch more).  Recording costs a few microseconds and does not block the host, so timed work
  overlaps with the host as it does in real use; the events are read (one wait on the end event)
  only when ``.ms`` is asked for.  Use this for kernels, copies, decode steps: "how long did the
  GPU spend".
* **Synchronize + host clock** (``events=False``): ``torch.cuda.synchronize(device)`` before
  reading the start time (so earlier work is not charged to this region) and again before
  reading the end time (so this region's work is).  This is wall time as a caller that waits for
  the result experiences it: launch overhead, the work, and the sync latency.  Use it when the
  host side is part of the cost (a whole request, a Python loop of launches), or to compare with
  a CPU measurement of the same thing.

On a CPU (or ``meta``, or any non-CUDA device) both are ``time.perf_counter()`` and
:func:`sync` is a no-op.  CUDA is only touched when the device asks for it: nothing here
initializes CUDA for CPU timings.

API::

    sync(device)                                   # torch.cuda.synchronize on CUDA, else nothing
    with device_timer(device) as t:                # DeviceTimer
        work()
    t.ms                                           # float milliseconds (waits for the end event)
    time_call(fn, device, warmup=1, repeats=5)     # list[float] ms, one per repeat
    time_replays(fn, device, calls=16, repeats=5)  # list[float] ms per call: CUDA-graph replays
    total = ElapsedTotal(device)                   # a running counter of many regions
    with total.region(): work()                    # (restores, swap-ins: admission work)
    total.seconds                                  # their sum (CUDA: resolved when read)

Inside a CUDA graph capture no event can be timed: :meth:`ElapsedTotal.region` then records
nothing (the capture's work is not a host-visible region).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any
from collections.abc import Callable, Iterator

import torch

__all__ = ["as_device", "is_cuda", "sync", "DeviceTimer", "device_timer", "time_call", "time_replays", "ElapsedTotal"]

# GPU cycles of the spin kernel time_replays enqueues before its start event (~0.25 ms at
# H100/H200 clocks), so the event fires once the host has launched what is timed
SPIN_CYCLES = 500_000


def as_device(device: Any) -> torch.device:
    """``device`` as a ``torch.device``: accepts a device, a string, a tensor, or ``None`` (CPU)."""
    if device is None:
        return torch.device("cpu")
    if isinstance(device, torch.Tensor):
        return device.device
    return device if isinstance(device, torch.device) else torch.device(device)


def is_cuda(device: Any) -> bool:
    """Whether work on ``device`` runs asynchronously on a CUDA stream."""
    return as_device(device).type == "cuda"


def sync(device: Any = None) -> None:
    """Wait until every stream of ``device`` has finished its queued work (no-op off CUDA)."""
    dev = as_device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class DeviceTimer:
    """Times the region of a ``with`` block on ``device``; read the result as ``.ms`` / ``.seconds``.

    On CUDA with ``events=True`` two timing events bracket the region on the device's current
    stream and ``.ms`` is their elapsed time (read lazily: it waits for the end event only then).
    With ``events=False`` the device is synchronized at both ends and the host clock is read.
    Off CUDA it is ``time.perf_counter()``.  A timer can be entered again; each use replaces
    the previous measurement.
    """

    def __init__(self, device: Any = None, *, events: bool = True) -> None:
        self.device = as_device(device)
        self.cuda = self.device.type == "cuda"
        self.events = bool(events) and self.cuda
        self._start: Any = None
        self._end: Any = None
        self._t0 = 0.0
        self._ms: float | None = None

    def __enter__(self) -> DeviceTimer:
        self._ms = None
        if self.events:
            stream = torch.cuda.current_stream(self.device)
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record(stream)
        else:
            sync(self.device)
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.events:
            self._end.record(torch.cuda.current_stream(self.device))
        else:
            sync(self.device)
            self._ms = (time.perf_counter() - self._t0) * 1e3

    @property
    def ms(self) -> float:
        """Milliseconds the region took (device time with events, else synchronized wall time)."""
        if self._ms is None:
            if self._end is None:
                raise RuntimeError("DeviceTimer.ms read before the timed region ended")
            self._end.synchronize()
            self._ms = float(self._start.elapsed_time(self._end))
        return self._ms

    @property
    def seconds(self) -> float:
        return self.ms / 1e3


def device_timer(device: Any = None, *, events: bool = True) -> DeviceTimer:
    """``with device_timer(dev) as t: work()`` then ``t.ms`` (see :class:`DeviceTimer`)."""
    return DeviceTimer(device, events=events)


def time_call(fn: Callable[[], Any], device: Any = None, *, warmup: int = 1, repeats: int = 5,
              events: bool = True) -> list[float]:
    """Milliseconds of each of ``repeats`` calls of ``fn()`` on ``device``, after ``warmup`` untimed calls.

    On CUDA with events every call is bracketed by its own event pair and all are read after one
    final wait, so the calls run back to back as in real use; with ``events=False`` each call is
    synchronized at both ends and timed on the host.  Off CUDA: ``perf_counter`` per call.
    """
    if repeats < 1:
        raise ValueError("time_call: repeats must be >= 1")
    for _ in range(max(0, warmup)):
        fn()
    timers = []
    sync(device)                      # warmup work is not charged to the first repeat
    for _ in range(repeats):
        with DeviceTimer(device, events=events) as t:
            fn()
        timers.append(t)
    return [t.ms for t in timers]


def time_replays(fn: Callable[[], Any], device: Any = None, *, calls: int = 16, repeats: int = 5,
                 warmup: int = 1) -> list[float]:
    """Milliseconds per call of ``fn()``, one figure per repeat, for calls too short to time alone.

    On CUDA a single call of a small layer is a few microseconds of GPU work and tens of
    microseconds of Python launch (and a synchronize): timing it alone measures the host.  Here
    ``calls`` back-to-back calls are captured in one CUDA graph (after ``warmup`` eager rounds on
    a side stream, which also compile kernels and create library handles); a sample is one replay
    between timing events, divided by ``calls``; a spin kernel (``torch.cuda._sleep``) before the
    start event keeps the GPU busy while the host launches the replay.  If the capture fails the
    eager calls are timed between the events instead.  ``fn`` must be capturable (no host sync).
    Off CUDA: :func:`time_call` of ``calls`` calls a sample (``perf_counter``), per call.
    """
    if calls < 1 or repeats < 1:
        raise ValueError("time_replays: calls and repeats must be >= 1")
    dev = as_device(device)

    def batch() -> None:
        for _ in range(calls):
            fn()

    if dev.type != "cuda":
        return [ms / calls for ms in time_call(batch, dev, warmup=warmup, repeats=repeats)]
    sync(dev)
    side = torch.cuda.Stream(dev)
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            batch()
    torch.cuda.current_stream(dev).wait_stream(side)
    sync(dev)
    graph = None
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            batch()
        graph.replay()
        sync(dev)
    except Exception:  # noqa: BLE001 - not capturable: the eager calls between the events
        graph = None
        sync(dev)
    spin = getattr(torch.cuda, "_sleep", None)
    out = []
    for _ in range(repeats):
        if spin is not None:
            spin(SPIN_CYCLES)
        with DeviceTimer(dev) as t:
            if graph is not None:
                graph.replay()
            else:
                batch()
        out.append(t.ms / calls)
    return out


class ElapsedTotal:
    """The running sum of many timed regions, as a counter: ``with total.region(): ...``, then
    ``total.seconds``.  Off CUDA each region adds its ``perf_counter`` time at once.  On CUDA each
    region is a pair of timing events on the current stream (the stream's time through the
    region: the work it enqueued and any GPU-side waits in it, e.g. on a copy); the pairs are
    summed when ``seconds`` is read, which waits for the last end event.  Pending pairs the GPU
    has already passed are folded in every ``resolve_every`` regions, so a long run keeps a
    bounded list.  ``device``: the default for regions (a region may name its own)."""

    def __init__(self, device: Any = None, *, resolve_every: int = 1024) -> None:
        self.device = as_device(device)
        self.resolve_every = max(1, int(resolve_every))
        self._done = 0.0
        self._pending: list[tuple] = []

    @contextmanager
    def region(self, device: Any = None) -> Iterator[None]:
        dev = as_device(device) if device is not None else self.device
        if dev.type != "cuda":
            t0 = time.perf_counter()
            try:
                yield
            finally:
                self._done += time.perf_counter() - t0
            return
        if torch.cuda.is_current_stream_capturing():
            yield                                  # a capture: no event can be timed here
            return
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(dev))
        try:
            yield
        finally:
            end.record(torch.cuda.current_stream(dev))
            self._pending.append((start, end))
            if len(self._pending) >= self.resolve_every:
                self._fold(wait=False)

    def _fold(self, wait: bool) -> None:
        keep = []
        for start, end in self._pending:
            if wait:
                end.synchronize()
            elif not end.query():
                keep.append((start, end))
                continue
            self._done += start.elapsed_time(end) / 1e3
        self._pending = keep

    def add(self, seconds: float) -> None:
        """Add host-measured seconds (work that is not on a device stream)."""
        self._done += seconds

    @property
    def pending(self) -> int:
        """Regions not yet summed (CUDA event pairs)."""
        return len(self._pending)

    @property
    def seconds(self) -> float:
        if self._pending:
            self._fold(wait=True)
        return self._done

    def reset(self, seconds: float = 0.0) -> None:
        self._pending = []
        self._done = float(seconds)
