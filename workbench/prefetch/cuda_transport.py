"""The CUDA link: pinned host memory -> HBM on a side stream, ordered by events.

Nothing here blocks the host: ``start`` enqueues the copy on the side stream after an optional
event, ``wait`` makes the compute stream wait on the copy's ready event.  The whole schedule is
stream operations, so a CUDA graph captures it (the copies become graph nodes).  Written without
a GPU in the development session; ``tests/prefetch/test_cuda_prefetch.py`` checks it in
``scripts/device_check.sh``.
"""

from __future__ import annotations

import time

import torch

from workbench.errors import ConfigError
from workbench.measure.timing import sync
from workbench.prefetch.transports import Job, Transport, as_bytes


class CudaTransport(Transport):
    """Pinned host -> HBM on a side stream.  ``start(key, dst, after=event)``: the side stream
    waits for ``after`` (the buffer's previous user finished), copies, records ``job.ready``;
    ``wait(job)``: the *current* stream waits for ``job.ready``.  Nothing blocks the host, so a
    CUDA graph captures the copies and the waits.  ``timing=True`` records start/end events per
    copy (not while capturing), resolved into ``job.started/finished`` by :meth:`resolve`."""

    kind = "cuda"
    link = "pinned host -> HBM"

    def __init__(self, device=None, timing: bool = True) -> None:
        if not torch.cuda.is_available():
            raise ConfigError("CudaTransport needs a CUDA device (this machine has none); use DiskTransport or "
                              "HostTransport on a CPU")
        super().__init__()
        self.device = torch.device(device or "cuda")
        self.stream = torch.cuda.Stream(self.device)
        self.timing = timing
        self._data: dict[object, torch.Tensor] = {}
        # the origin that maps event times to the host clock: recorded on an idle device and read
        # once the GPU has passed it (an event recorded behind queued work - a model load, a bench -
        # would shift every mapped time by that backlog)
        self._base = torch.cuda.Event(enable_timing=True)
        sync(self.device)
        self._base.record(torch.cuda.current_stream(self.device))
        sync(self.device)
        self._base_host = time.perf_counter()
        self.epoch = 0          # counts captures (the streamer bumps it when a captured step begins)

    def _pinned(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _store(self, key, raw: torch.Tensor) -> None:
        host = self._pinned(raw.numel())
        host.copy_(raw)
        self._data[key] = host

    def _store_many(self, keys: list, raws: list) -> None:
        """One pinned buffer and one device -> host copy for all the records (a pinned allocation
        and a synchronous copy per record cost a host sync each); each key holds a view of it,
        so the buffer lives until its last record is dropped."""
        if len(raws) == 1:
            self._store(keys[0], raws[0])
            return
        slab = self._pinned(sum(r.numel() for r in raws))
        slab.copy_(torch.cat([r.reshape(-1) for r in raws]))
        off = 0
        for key, raw in zip(keys, raws):
            n = raw.numel()
            self._data[key] = slab[off:off + n]
            off += n

    def _forget(self, key) -> None:
        self._data.pop(key, None)

    def buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def start(self, key, dst: torch.Tensor, after=None) -> Job:
        n = self.nbytes_of(key)
        out = as_bytes(dst)[:n]
        capturing = torch.cuda.is_current_stream_capturing()
        job = Job(key, n, time.perf_counter(), captured=capturing, epoch=self.epoch)
        if after is None:       # no event given: after everything enqueued so far on the compute stream
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if after is not None:
                self.stream.wait_event(after)
            if self.timing and not capturing:
                job.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                job.events[0].record(self.stream)
            out.copy_(self._data[key], non_blocking=True)
            if job.events is not None:
                job.events[1].record(self.stream)
            job.ready = torch.cuda.Event()
            job.ready.record(self.stream)
        return job

    def wait(self, job: Job) -> None:
        """The compute stream waits for the copy - when that wait is expressible: a job of the
        capture under way, or an eager job outside any capture.  A job submitted inside a
        captured graph is ordered by the graph itself (its copy stream joins before the graph
        ends, and replays run in stream order); an eager job seen during a capture was finished
        by the synchronisation that precedes a capture."""
        capturing = torch.cuda.is_current_stream_capturing()
        if capturing and job.captured and job.epoch == self.epoch or not capturing and not job.captured:
            torch.cuda.current_stream(self.device).wait_event(job.ready)

    def join(self) -> None:
        """The compute stream waits for every copy submitted so far (the end of a captured step:
        streams forked during a capture must join before it ends)."""
        torch.cuda.current_stream(self.device).wait_stream(self.stream)

    def resolve(self, jobs) -> None:
        """Fill ``started/finished`` (host-clock seconds) of finished, timed jobs."""
        for job in jobs:
            if job.events is None or job.finished is not None or not job.events[1].query():
                continue
            s, e = job.events
            job.started = self._base_host + self._base.elapsed_time(s) / 1e3
            job.finished = self._base_host + self._base.elapsed_time(e) / 1e3
