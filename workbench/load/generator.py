"""The load generator: open-loop (constant / Poisson) or closed-loop users, with k6 stages, or a
recorded trace replayed at its own arrival times.

::

    from workbench.load import LoadConfig, FakeTarget, run_load_sync
    cfg = LoadConfig(mode="poisson", stages=[(2, 20), (3, 20), (2, 0)], max_tokens=16, seed=1)
    res = run_load_sync(FakeTarget(capacity=4), cfg)
    res.summary()                   # per stage and overall: P50/P95/P99 TTFT, ITL, E2E, rates

* ``constant`` / ``poisson``: requests are sent on the arrival process's schedule whatever
  the target does (open loop: a slow server builds a queue, which is what TTFT should show).
* ``closed``: ``concurrency`` virtual users, each sending its next request when the previous
  one finished (plus ``think_time_s``); with stages, ``target`` is the number of users
  (users above the target finish their request and then wait; k6's graceful ramp-down).
* ``trace``: ``trace`` (a :class:`workbench.engine.traces.Trace`, e.g. ``TraceWorkload.trace()``)
  replayed open loop: request i is sent ``trace.requests[i].at`` seconds after the start with
  its own prompt, ``params.max_tokens`` and priority, and its params' ``temperature`` and
  ``ignore_eos`` (with ``top_p`` / ``top_k`` / ``seed`` / ``stop`` when set) as sampling keyword
  arguments, so a server generates the recorded number of tokens; ``sampling`` overrides them.
  Its schedule is one stage, ``"trace"``, whose target follows the recorded rate (requests/s in
  each tenth of the trace).  Requests out of time order are sorted (stable).

Bounds: ``max_requests`` (count) and ``max_duration_s`` (wall time; requests still in flight
then are cancelled and recorded as ``cancelled``).  Without ``max_duration_s`` the run waits
for every request sent before the stages ended.

Inside Jupyter, ``await run_load(target, cfg)`` runs on the notebook's own event loop;
:func:`run_load_sync` works everywhere (it uses a private loop in a thread when one is
already running).  Observers - ``fn(run, record)`` - are called with each finished record and
every ``tick_s`` with ``record=None`` (live views read ``run``'s counters then).

``LoadRun(..., clock=fn)``: the clock the run reads (default ``time.perf_counter``); give the
event loop's ``loop.time`` together with the same clock for the target to run a scripted load
on a virtual-time loop (deterministic, no waiting).  ``run.stop()`` (any thread) ends a run
early, as ``max_duration_s`` does.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, UTC
from collections.abc import Callable, Sequence

from workbench.errors import ConfigError
from workbench.load.arrivals import Schedule, Segment, Stage, arrival_offsets
from workbench.load.result import LoadResult, RequestRecord
from workbench.load.target import Prompt, TokenEvent

MODES = ("constant", "poisson", "closed", "trace")
TRACE_BINS = 10                          # the trace schedule's target: the recorded rate in each tenth
Observer = Callable[["LoadRun", "RequestRecord | None"], None]


@dataclass
class LoadConfig:
    mode: str = "poisson"
    rate: float | None = None            # requests/s (open loop); with stages: the starting rate
    concurrency: int | None = None       # virtual users (closed loop); with stages: the starting count
    stages: Sequence | None = None       # [(duration_s, target[, name]), ...]: linear ramps
    max_requests: int | None = None
    max_duration_s: float | None = None
    max_tokens: int = 32
    prompts: Sequence[Prompt] | Callable[[int], Prompt] | None = None   # None: held-out prompts
    num_prompts: int = 64                # how many held-out prompts when prompts is None
    priority: int | Callable[[int], int] = 0   # or fn(request index) -> priority
    think_time_s: float = 0.0            # closed loop: pause between a user's requests
    sampling: dict = field(default_factory=dict)   # extra keyword arguments for target.send
    seed: int = 0
    tick_s: float = 0.25                 # observers' periodic call
    name: str = ""
    trace: object | None = None          # mode="trace": a Trace (requests with at, prompt, params, priority)

    def __post_init__(self) -> None:
        def bad(name, why):
            raise ConfigError(f"LoadConfig.{name}={getattr(self, name)!r} {why}")

        if self.mode not in MODES:
            bad("mode", f"must be one of {MODES}")
        if self.mode == "trace" or self.trace is not None:
            self._check_trace()
        open_loop = self.mode != "closed"
        if self.stages is not None:
            self.stages = [Stage.coerce(s, i, "LoadConfig.stages") for i, s in enumerate(self.stages)]
            if not self.stages:
                bad("stages", "is empty: give at least one (duration_s, target)")
        if self.rate is not None and not (self.rate >= 0 and math.isfinite(self.rate)):
            bad("rate", "must be a finite number >= 0 (requests per second)")
        if self.concurrency is not None and not (isinstance(self.concurrency, int) and self.concurrency >= 0):
            bad("concurrency", "must be an integer >= 0 (virtual users)")
        if self.stages is None and self.mode != "trace":
            if open_loop and not self.rate:
                bad("rate", f"must be > 0 for mode={self.mode!r} without stages")
            if not open_loop and not self.concurrency:
                bad("concurrency", "must be >= 1 for mode='closed' without stages")
            if self.max_requests is None and self.max_duration_s is None:
                bad("max_requests", "and max_duration_s are both None without stages: the run would never end")
        elif not open_loop and any(s.target != int(s.target) for s in self.stages):
            bad("stages", "targets are numbers of virtual users in mode='closed': use whole numbers")
        if self.max_requests is not None and not (isinstance(self.max_requests, int) and self.max_requests >= 1):
            bad("max_requests", "must be an integer >= 1 or None")
        if self.max_duration_s is not None and not self.max_duration_s > 0:
            bad("max_duration_s", "must be > 0 seconds or None")
        if not (isinstance(self.max_tokens, int) and self.max_tokens >= 1):
            bad("max_tokens", "must be an integer >= 1")
        if not self.think_time_s >= 0:
            bad("think_time_s", "must be >= 0 seconds")
        if not self.tick_s > 0:
            bad("tick_s", "must be > 0 seconds")
        if self.prompts is not None and not callable(self.prompts):
            if isinstance(self.prompts, str) or len(self.prompts) == 0:
                bad("prompts", "must be a non-empty list of prompts (str or token-id lists) or fn(i) -> prompt")
        if not (callable(self.priority) or isinstance(self.priority, int)):
            bad("priority", "must be an int or fn(request index) -> int")

    def _check_trace(self) -> None:
        """mode="trace": a trace with requests, each with a time >= 0, a prompt and max_tokens;
        the requests in time order (a stable sort of ``trace.requests`` when they are not)."""
        if self.mode != "trace":
            raise ConfigError(f"LoadConfig.trace is given with mode={self.mode!r}: a trace is replayed with "
                              "mode='trace' (its own arrival times)")
        if self.trace is None:
            raise ConfigError("LoadConfig(mode='trace') needs trace=<a Trace> (e.g. TraceWorkload.trace())")
        for name in ("rate", "concurrency", "stages", "prompts"):
            if getattr(self, name) is not None:
                raise ConfigError(f"LoadConfig.{name} is given with mode='trace': the trace's own arrival times "
                                  "and prompts are sent; leave it None")
        reqs = getattr(self.trace, "requests", None)
        if reqs is None:
            raise ConfigError(f"LoadConfig.trace: expected a Trace (with .requests), got {type(self.trace).__name__}")
        if not len(reqs):
            raise ConfigError("LoadConfig.trace has no request: nothing to replay")
        for i, r in enumerate(reqs):
            where = f"LoadConfig.trace.requests[{i}]"
            at = getattr(r, "at", None)
            if not (isinstance(at, (int, float)) and not isinstance(at, bool) and math.isfinite(at) and at >= 0):
                raise ConfigError(f"{where}.at={at!r} must be a finite number >= 0 (seconds after the start)")
            p = getattr(r, "prompt", None)
            if not ((isinstance(p, str) or isinstance(p, (list, tuple))) and len(p)):
                raise ConfigError(f"{where}.prompt must be a non-empty text or list of token ids")
            mt = getattr(getattr(r, "params", None), "max_tokens", None)
            if not (isinstance(mt, int) and mt >= 1):
                raise ConfigError(f"{where}.params.max_tokens={mt!r} must be an integer >= 1 (SamplingParams)")
        self._trace_requests = sorted(reqs, key=lambda r: r.at)

    def trace_requests(self) -> list:
        """mode="trace": the trace's requests in time order (what request i of the run sends)."""
        return getattr(self, "_trace_requests", [])

    def schedule(self) -> Schedule:
        if self.mode == "trace":
            return trace_schedule([r.at for r in self.trace_requests()])
        start = self.rate if self.mode != "closed" else self.concurrency
        if self.stages is None:
            return Schedule.constant(start)
        return Schedule.from_stages(self.stages, start=start or 0.0)

    def describe(self) -> dict:
        """A JSON-able description (prompts and callables by kind, not content)."""
        d = {k: getattr(self, k) for k in ("mode", "rate", "concurrency", "max_requests", "max_duration_s",
                                           "max_tokens", "think_time_s", "sampling", "seed", "name")}
        d["stages"] = None if self.stages is None else [[s.duration_s, s.target, s.name] for s in self.stages]
        if self.mode == "trace":
            reqs = self.trace_requests()
            dur = reqs[-1].at
            d.update(max_tokens="per request (the trace's)", prompts=f"trace of {len(reqs)}",
                     priority="per request (the trace's)",
                     trace={"requests": len(reqs), "duration_s": dur,
                            "rate_per_s": len(reqs) / dur if dur > 0 else None})
            return d
        p = self.prompts
        d["prompts"] = (f"held-out x{self.num_prompts}" if p is None else
                        f"fn {getattr(p, '__name__', '?')}" if callable(p) else f"list of {len(p)}")
        d["priority"] = (self.priority if isinstance(self.priority, int) else
                         f"fn {getattr(self.priority, '__name__', '?')}")
        return d


def trace_schedule(times: Sequence[float], bins: int = TRACE_BINS) -> Schedule:
    """The schedule of a trace whose requests arrive at ``times`` (sorted, seconds): one stage,
    ``"trace"``, over [0, last arrival], whose value is the recorded rate (requests/s) in each of
    ``bins`` equal spans - the live view's target line.  All at time 0: one endless segment of
    rate NaN (a burst has no rate)."""
    dur = max(times) if len(times) else 0.0
    if not dur > 0:
        return Schedule([Segment(0.0, math.inf, math.nan, math.nan, 0, "trace")])
    width = dur / bins
    counts = [0] * bins
    for t in times:
        counts[min(int(t / width), bins - 1)] += 1
    edges = [k * width for k in range(bins)] + [dur]
    return Schedule([Segment(edges[k], edges[k + 1], counts[k] / width, counts[k] / width, 0, "trace")
                     for k in range(bins)])


def trace_sampling(params) -> dict:
    """The sampling keyword arguments a trace request sends (see the module docstring)."""
    out = {"temperature": float(params.temperature), "ignore_eos": bool(params.ignore_eos)}
    for name, unset in (("top_p", 1.0), ("top_k", 0), ("seed", None), ("stop", [])):
        v = getattr(params, name, unset)
        if v != unset and v is not None:
            out[name] = list(v) if name == "stop" else v
    return out


class LoadRun:
    """One run of ``config`` against ``target``; live counters for observers while it runs.

    ``run.arun()`` (async) or ``run.run()`` (sync) returns the :class:`LoadResult`.  While it
    runs: ``elapsed()``, ``in_flight``, ``sent``, ``counts`` (by status), ``records``
    (finished so far), ``stage`` / ``stage_name`` and ``target_value()`` (the current rate or
    number of users)."""

    def __init__(self, target, config: LoadConfig, observers: Sequence[Observer] = (),
                 clock: Callable[[], float] = time.perf_counter) -> None:
        if not hasattr(target, "send"):
            raise ConfigError(f"run_load: target {type(target).__name__} has no send(prompt, max_tokens, "
                              "priority, **sampling) method (see workbench.load.target)")
        self.target, self.config, self.clock = target, config, clock
        self.observers: list[Observer] = list(observers)
        self.schedule = config.schedule()
        self._prompt = self._prompt_source()
        self.records: list[RequestRecord] = []
        self.counts = {"ok": 0, "error": 0, "rejected": 0, "cancelled": 0}
        self.sent = 0
        self.in_flight = 0
        self.max_in_flight = 0
        self.done = False
        self.t_start: float | None = None
        self._tasks: set[asyncio.Task] = set()
        self._observer_error: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_event: asyncio.Event | None = None
        self._stop_requested = False
        self._end_why = "max_duration_s"
        self._ending = False               # set when the run's time is up: no user takes another ticket

    def add_observer(self, fn: Observer) -> LoadRun:
        self.observers.append(fn)
        return self

    # ---- live state -----------------------------------------------------------------------------
    def elapsed(self) -> float:
        return 0.0 if self.t_start is None else self.clock() - self.t_start

    def target_value(self, t: float | None = None) -> float:
        return self.schedule.value(self.elapsed() if t is None else t)

    @property
    def stage(self) -> int:
        return self.schedule.stage_at(self.elapsed())

    @property
    def stage_name(self) -> str:
        return self.schedule.segments[self.stage].name

    def _notify(self, record: RequestRecord | None) -> None:
        for fn in self.observers:
            try:
                fn(self, record)
            except Exception as e:   # a broken view must not stop the measurement, but is not hidden
                if self._observer_error is None:
                    self._observer_error = f"{type(e).__name__}: {e}"
                    warnings.warn(f"load observer {fn!r} failed ({self._observer_error}); the run goes on",
                                  RuntimeWarning, stacklevel=2)

    # ---- requests -------------------------------------------------------------------------------
    def _prompt_source(self) -> Callable[[int], Prompt]:
        if self.config.mode == "trace":
            return lambda i: self.config.trace_requests()[i].prompt
        p = self.config.prompts
        if callable(p):
            return p
        if p is None:
            from workbench.data import heldout_prompts

            p = heldout_prompts(self.config.num_prompts, seed=self.config.seed)
        prompts = list(p)
        return lambda i: prompts[i % len(prompts)]

    def _request_parts(self, i: int) -> tuple[Prompt, int, int, dict]:
        """Request ``i``'s prompt, max_tokens, priority and sampling keyword arguments."""
        cfg = self.config
        if cfg.mode == "trace":
            r = cfg.trace_requests()[i]
            return (r.prompt, int(r.params.max_tokens), int(getattr(r, "priority", 0) or 0),
                    {**trace_sampling(r.params), **cfg.sampling})
        prio = cfg.priority(i) if callable(cfg.priority) else cfg.priority
        return self._prompt(i), cfg.max_tokens, prio, cfg.sampling

    def _take_ticket(self) -> int | None:
        cfg = self.config
        if cfg.max_requests is not None and self.sent >= cfg.max_requests:
            return None
        self.sent += 1
        return self.sent - 1

    async def _request(self, i: int, scheduled: float, user: int | None = None) -> RequestRecord:
        t0 = self.t_start
        prompt, max_tokens, prio, sampling = self._request_parts(i)
        sent = self.clock() - t0
        stage = self.schedule.stage_at(min(scheduled, sent))
        rec = RequestRecord(id=i, stage=stage, stage_name=self.schedule.segments[stage].name, priority=prio,
                            scheduled=scheduled, sent=sent, user=user, prompt_len=len(prompt))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        stream = None
        try:
            stream = self.target.send(prompt, max_tokens, priority=prio, **sampling)
            async for ev in stream:
                self._apply(rec, ev, t0, self.clock)
                if rec.status != "pending":
                    break
            if rec.status == "pending":
                rec.status, rec.reason = "error", "target stream ended without a finished event"
        except asyncio.CancelledError:
            rec.status, rec.reason = "cancelled", f"in flight when the run ended ({self._end_why})"
            raise
        except Exception as e:   # the target's bug or a bad prompt: recorded, the run goes on
            rec.status, rec.reason = "error", f"{type(e).__name__}: {e}"
        finally:
            cancelled_while_closing = False
            if stream is not None and hasattr(stream, "aclose"):
                try:
                    await asyncio.shield(stream.aclose())
                except asyncio.CancelledError:
                    # the run ended while this request closed its stream: recorded as it finished,
                    # and the cancellation goes on below - swallowed, it let a closed-loop user that
                    # awaited this request carry on sending for ever after the run's end
                    cancelled_while_closing = True
                except Exception:  # noqa: BLE001 - a stream that fails to close: the record stands
                    pass
            rec.end = self.clock() - t0
            self.in_flight -= 1
            self.counts[rec.status] = self.counts.get(rec.status, 0) + 1
            self.records.append(rec)
            self._notify(rec)
            if cancelled_while_closing:
                raise asyncio.CancelledError
        return rec

    @staticmethod
    def _apply(rec: RequestRecord, ev: TokenEvent, t0: float,
               clock: Callable[[], float] = time.perf_counter) -> None:
        t = (ev.time if ev.time is not None else clock()) - t0
        rec.token_times.extend([t] * ev.tokens)
        if ev.rejected:
            rec.status, rec.reason = "rejected", ev.error or ev.finish_reason or "rejected"
        elif ev.error is not None:
            rec.status, rec.reason = "error", ev.error
        elif ev.finished:
            rec.status = "ok"
        rec.finish_reason = ev.finish_reason if ev.finished else rec.finish_reason

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # ---- arrival processes ----------------------------------------------------------------------
    async def _sleep_until(self, offset: float) -> None:
        # asyncio may wake a timer early (its own clock, not this run's; a loaded machine): sleep again,
        # bounded so that a virtual clock that rounds cannot spin - nothing is sent before its time
        for _ in range(100):
            delay = self.t_start + offset - self.clock()
            if delay <= 0:
                return
            await asyncio.sleep(delay)

    def _offsets(self):
        if self.config.mode == "trace":
            return (r.at for r in self.config.trace_requests())
        return arrival_offsets(self.schedule, self.config.mode, self.config.seed)

    async def _open_loop(self) -> None:
        cap = self.config.max_requests
        for offset in self._offsets():
            if cap is not None and self.sent >= cap:    # all sent: the run does not wait for the next arrival
                break
            await self._sleep_until(offset)
            i = self._take_ticket()
            if i is None:
                break
            self._spawn(self._request(i, offset))
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)

    async def _user(self, u: int) -> None:
        sched, cfg = self.schedule, self.config
        while not self._ending:
            now = self.clock() - self.t_start
            if sched.value(now) <= u:          # above the target: wait until the ramp needs this user
                t = sched.first_time_above(u, now)
                if t is None:
                    return
                await self._sleep_until(t)
                continue
            i = self._take_ticket()
            if i is None:
                return
            await self._spawn(self._request(i, now, user=u))
            if cfg.think_time_s:
                await asyncio.sleep(cfg.think_time_s)

    async def _closed_loop(self) -> None:
        users = max(s.v0 for s in self.schedule.segments) if self.config.stages is None else \
            max([s.target for s in self.config.stages] + [self.config.concurrency or 0])
        tasks = [asyncio.ensure_future(self._user(u)) for u in range(int(users))]
        try:
            await asyncio.gather(*tasks)
        finally:
            # gather is done at its first cancelled (or failed) user while the others may still be
            # running: the run is over only when every user is
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _ticker(self) -> None:
        while True:
            await asyncio.sleep(self.config.tick_s)
            self._notify(None)

    # ---- the run ---------------------------------------------------------------------------------
    def stop(self) -> None:
        """End the run now, from any thread (a notebook cell, a test, a view): as when
        ``max_duration_s`` is reached, nothing more is sent and requests still in flight are
        cancelled (recorded as ``cancelled``).  Before the run starts: it ends at once."""
        self._stop_requested = True
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:               # the loop closed in between: the run is over anyway
                pass

    async def arun(self) -> LoadResult:
        if self.t_start is not None:
            raise ConfigError("this LoadRun has already run; make a new one (or call run_load again)")
        started_at = datetime.now(UTC).isoformat(timespec="seconds")
        self._loop, self._stop_event = asyncio.get_running_loop(), asyncio.Event()
        if self._stop_requested:
            self._stop_event.set()
        self.t_start = self.clock()
        drive = self._spawn_driver()
        ticker = asyncio.get_running_loop().create_task(self._ticker())
        stopper = asyncio.get_running_loop().create_task(self._stop_event.wait())
        try:
            done, _ = await asyncio.wait({drive, stopper}, timeout=self.config.max_duration_s,
                                         return_when=asyncio.FIRST_COMPLETED)
            if drive not in done:              # time is up (or stop()): stop sending, cancel what is in flight
                if stopper in done:
                    self._end_why = "stop() was called"
                self._ending = True
                drive.cancel()
                for t in list(self._tasks):
                    t.cancel()
                await asyncio.gather(drive, *list(self._tasks), return_exceptions=True)
            elif drive.exception() is not None:
                raise drive.exception()
        finally:
            ticker.cancel()
            stopper.cancel()
            await asyncio.gather(ticker, stopper, return_exceptions=True)
        duration = max([self.clock() - self.t_start] + [r.end for r in self.records if r.end is not None])
        self.done = True
        self._notify(None)
        stages = [(k, name, a, min(b, duration), tgt) for k, name, a, b, tgt in self._stage_windows()
                  if a < duration]
        return LoadResult(records=sorted(self.records, key=lambda r: r.id), duration_s=duration, stages=stages,
                          config=self.config.describe(), started_at=started_at)

    def _stage_windows(self) -> list[tuple[int, str, float, float, float]]:
        """(stage, name, t0, t1, target) per stage; a stage of several segments (a trace's tenths) is
        one window whose target is its mean value (a trace: its recorded rate)."""
        windows = self.schedule.stage_windows()
        if len({w[0] for w in windows}) == len(windows):
            return windows
        merged: dict[int, list] = {}
        for k, name, a, b, _ in windows:
            m = merged.setdefault(k, [k, name, a, b])
            m[2], m[3] = min(m[2], a), max(m[3], b)
        sched = self.schedule
        return [(k, name, a, b, (sched.integral(b) - sched.integral(a)) / (b - a) if math.isfinite(b) and b > a
                 else sched.value(a)) for k, name, a, b in merged.values()]

    def _spawn_driver(self) -> asyncio.Task:
        coro = self._closed_loop() if self.config.mode == "closed" else self._open_loop()
        return asyncio.get_running_loop().create_task(coro)

    def run(self) -> LoadResult:
        """Blocking; works inside Jupyter's running event loop (runs in a thread then)."""
        return _run_sync(self.arun, self.target)


async def run_load(target, config: LoadConfig, observers: Sequence[Observer] = ()) -> LoadResult:
    """Run ``config`` against ``target`` on the current event loop."""
    return await LoadRun(target, config, observers).arun()


def run_load_sync(target, config: LoadConfig, observers: Sequence[Observer] = ()) -> LoadResult:
    """:func:`run_load`, blocking; inside a running loop (Jupyter) it uses a private loop in a
    thread - then observers are called from that thread."""
    return LoadRun(target, config, observers).run()


def _run_sync(make_coro, target) -> LoadResult:
    async def main():
        try:
            return await make_coro()
        finally:   # per-loop resources (an HTTP client) die with this private loop
            if hasattr(target, "aclose"):
                await target.aclose()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(main())
    box: dict = {}

    def worker():
        try:
            box["result"] = asyncio.run(main())
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    th = threading.Thread(target=worker, name="workbench-load", daemon=True)
    th.start()
    th.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
