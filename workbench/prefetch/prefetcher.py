"""The prefetcher: one interface over any transport - submit a fetch, wait for it, read stats.

::

    pf = Prefetcher(DiskTransport())          # or HostTransport(), CudaTransport()
    pf.put("layer.5", weights)                # into the slow tier (once)
    pf.submit("layer.5", buf)                 # predicted: start copying now ...
    ...                                       # ... while something else computes
    pf.wait("layer.5", buf)                   # at the moment of use: a hit if the copy is done
    pf.stats()                                # prefetch_hit_rate, stall_s, bytes, GB/s, prefetch_efficiency

``wait`` on a key nobody submitted is a *demand* fetch: it starts the copy then and stalls for
all of it (a misprediction costs time, never correctness).

The counters, named so they cannot be confused with the prefix cache's hit rate:

* ``prefetch_hit_rate`` - uses whose bytes were already in place at the moment of use;
* ``stall_s`` - time the consumer waited for copies;
* ``bytes`` / ``copy_s`` - what the copy lane moved and how long it was busy, so
  ``achieved_gbps``, and ``link_use`` = achieved / ``ceiling_gbps`` (a measured ceiling, set by
  :func:`workbench.prefetch.link.measure_link` or by hand);
* ``prefetch_efficiency`` - the share of copy time hidden behind compute:
  ``1 - stall_s / copy_s`` (clipped to [0, 1]).

Every copy, stall and (when the caller reports it) compute span is kept as a timeline event
(a Gantt chart's bars: :meth:`timeline`).  On CUDA, host clocks only see when work was
*enqueued*; there the times come from CUDA events, resolved once the GPU has passed them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import asdict, dataclass

import torch

from workbench.measure import timing
from workbench.prefetch.transports import Job, Transport

# CUDA: pending timing events are folded into the counters once this many wait (a long-running
# engine that never reads stats() would otherwise keep ~3 events per streamed layer per step)
RESOLVE_EVERY = 4096


@dataclass
class PrefetchStats:
    fetches: int = 0             # copies started
    predicted: int = 0           # ... ahead of their use
    demand: int = 0              # ... at the moment of use (nothing predicted them)
    uses: int = 0                # waits
    hits: int = 0                # ... whose bytes were already in place
    stall_s: float = 0.0
    bytes: int = 0               # bytes of finished copies
    reused: int = 0              # uses served by bytes an earlier fetch left in place (no copy)
    wasted: int = 0              # predicted fetches nobody used (cancelled)
    wasted_bytes: int = 0
    copy_s: float = 0.0          # the copy lane's busy time for them
    ceiling_gbps: float | None = None

    def as_dict(self) -> dict:
        d = asdict(self)
        d["prefetch_hit_rate"] = self.hits / self.uses if self.uses else None
        d["achieved_gbps"] = self.bytes / self.copy_s / 1e9 if self.copy_s else None
        d["link_use"] = (d["achieved_gbps"] / self.ceiling_gbps
                         if d["achieved_gbps"] is not None and self.ceiling_gbps else None)
        d["prefetch_efficiency"] = (min(1.0, max(0.0, 1.0 - self.stall_s / self.copy_s))
                                    if self.copy_s else None)
        return d


class Prefetcher:
    """Fetches over ``transport`` with hit / stall / bandwidth accounting and a timeline.
    ``history``: events kept for the timeline (oldest dropped)."""

    def __init__(self, transport: Transport, ceiling_gbps: float | None = None, history: int = 20_000,
                 name: str = "prefetch") -> None:
        self.transport, self.name = transport, name
        self.stats_ = PrefetchStats(ceiling_gbps=ceiling_gbps)
        self.pending: dict[object, Job] = {}
        self.events: deque[tuple] = deque(maxlen=history)   # (lane, label, start, end, step, nbytes)
        self._cuda = transport.kind == "cuda"
        self._unresolved: list[tuple] = []                  # CUDA: (job, before, after, label, step)
        self.step = 0                                       # the caller's step number, stamped on events

    # ---- the slow tier ---------------------------------------------------------------------------
    def put(self, key, data: torch.Tensor) -> None:
        self.transport.put(key, data)

    def put_many(self, items) -> None:
        """``put`` of several ``(key, data)`` pairs in one batch (see ``Transport.put_many``)."""
        self.transport.put_many(items)

    def __contains__(self, key) -> bool:
        return key in self.transport

    # ---- fetches ---------------------------------------------------------------------------------
    def submit(self, key, dst: torch.Tensor, after=None) -> Job:
        """Start copying ``key`` into ``dst`` (a no-op if it is already on its way)."""
        job = self.pending.get(key)
        if job is None:
            job = self.pending[key] = self.transport.start(key, dst, after)
            self.stats_.fetches += 1
            self.stats_.predicted += 1
        return job

    def wait(self, key, dst: torch.Tensor | None = None, label: str | None = None) -> Job:
        """At the moment of use: block until ``key``'s bytes are in place (CUDA: make the compute
        stream wait).  Not submitted: a demand fetch into ``dst`` now."""
        job = self.pending.pop(key, None)
        demand = job is None
        if demand:
            if dst is None:
                raise KeyError(f"prefetcher {self.name}: {key!r} was not submitted and no buffer was given")
            job = self.transport.start(key, dst)
            self.stats_.fetches += 1
            self.stats_.demand += 1
        st = self.stats_
        st.uses += 1
        label = label or str(key)
        if self._cuda:
            before = after = None
            if self.transport.timing and not torch.cuda.is_current_stream_capturing():
                before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                before.record()
            self.transport.wait(job)
            if after is not None:
                after.record()
                self._unresolved.append((job, before, after, label, self.step, demand))
                self._bound()
            return job
        hit = not demand and job.done()
        t0 = time.perf_counter()
        self.transport.wait(job)
        t1 = time.perf_counter()
        st.hits += hit
        st.stall_s += t1 - t0
        self._finished(job, label)
        if t1 - t0 > 0 and not hit:
            self.events.append(("stall", label, t0, t1, self.step, 0))
        return job

    def fetch_now(self, key, dst: torch.Tensor, label: str | None = None) -> Job:
        """A synchronous fetch (counted as a demand fetch and a use)."""
        self.pending.pop(key, None)
        return self.wait(key, dst, label)

    def reuse(self, label: str = "reuse") -> None:
        """A use whose bytes an earlier fetch left in place (a staging buffer kept from the last
        step): a hit that moved nothing."""
        self.stats_.uses += 1
        self.stats_.hits += 1
        self.stats_.reused += 1

    def cancel(self, key, label: str | None = None) -> bool:
        """A predicted fetch turned out unneeded: wait for its copy (a started copy cannot be
        recalled; its buffer is free afterwards) and count it as wasted.  False if not pending."""
        job = self.pending.pop(key, None)
        if job is None:
            return False
        t0 = time.perf_counter()
        try:
            self.transport.wait(job)
        except Exception:  # noqa: BLE001 - nobody uses these bytes
            return True
        if not self._cuda:
            self.stats_.stall_s += time.perf_counter() - t0      # waiting for a copy nobody needs is a stall too
        self.stats_.wasted += 1
        self.stats_.wasted_bytes += job.nbytes
        if not self._cuda:
            self._finished(job, label or f"wasted {key}")
        return True

    def _finished(self, job: Job, label: str) -> None:
        if job.seconds is not None:
            self.stats_.bytes += job.nbytes
            self.stats_.copy_s += job.seconds
            self.events.append(("copy", label, job.started, job.finished, self.step, job.nbytes))

    def compute(self, label: str, start, end) -> None:
        """Record a compute span (host seconds, or CUDA events on a CUDA transport)."""
        if self._cuda:
            self._unresolved.append((None, start, end, label, self.step, False))
            self._bound()
        else:
            self.events.append(("compute", label, start, end, self.step, 0))

    def _bound(self) -> None:
        if len(self._unresolved) >= RESOLVE_EVERY:
            self.resolve()

    def resolve(self) -> None:
        """CUDA: turn events the GPU has passed into counters and timeline events."""
        if not self._cuda:
            return
        tr = self.transport
        keep = []
        for item in self._unresolved:
            job, before, after, label, step, demand = item
            if not after.query() or (job is not None and job.events is not None and not job.events[1].query()):
                keep.append(item)
                continue
            t0 = tr._base_host + tr._base.elapsed_time(before) / 1e3
            t1 = tr._base_host + tr._base.elapsed_time(after) / 1e3
            if job is None:
                self.events.append(("compute", label, t0, t1, step, 0))
                continue
            tr.resolve([job])
            stall = max(0.0, t1 - t0)
            self.stats_.stall_s += stall
            self.stats_.hits += (not demand) and stall < 5e-6   # the stream did not wait (5 us: event resolution)
            if stall >= 5e-6:
                self.events.append(("stall", label, t0, t1, step, 0))
            self._finished(job, label)
        self._unresolved = keep

    # ---- reading ---------------------------------------------------------------------------------
    def stats(self) -> dict:
        self.resolve()
        return {"name": self.name, **self.transport.describe(), **self.stats_.as_dict()}

    def reset_stats(self) -> None:
        """Start the counters again.  CUDA: everything enqueued so far is pre-reset work, so the
        device finishes it first and its events resolve into the counters being discarded (not,
        later, into the new ones); nothing unresolved is carried over."""
        if self._cuda and not torch.cuda.is_current_stream_capturing():
            timing.sync(self.transport.device)
        self.resolve()
        self._unresolved = []
        self.stats_ = PrefetchStats(ceiling_gbps=self.stats_.ceiling_gbps)
        self.events.clear()

    def timeline(self) -> list[dict]:
        """The recorded events, times in seconds from the first one (a Gantt chart's rows)."""
        self.resolve()
        evs = sorted(self.events, key=lambda e: e[2])
        t0 = evs[0][2] if evs else 0.0
        return [{"lane": lane, "label": label, "start": s - t0, "end": e - t0, "step": step, "bytes": nbytes}
                for lane, label, s, e, step, nbytes in evs]

    def drain(self) -> None:
        """Wait for every pending copy (so buffers are not written after their owner is gone)."""
        for key in list(self.pending):
            job = self.pending.pop(key)
            try:
                self.transport.wait(job)
            except Exception:  # noqa: BLE001 - nobody uses these bytes
                pass
        if self._cuda:
            torch.cuda.current_stream(self.transport.device).wait_stream(self.transport.stream)

    def close(self) -> None:
        self.drain()
        self.transport.close()
