"""The batched engine on a background thread, for servers and load tests.

The engine itself is single-threaded; this wrapper owns it on one thread and takes requests
from any other thread (or asyncio event loop) through an inbox::

    aeng = AsyncEngine(LLMEngine(...)).start()
    async for ev in aeng.stream("The list type", params, priority=1):   # StreamEvents
        ...
    aeng.stop()

Input is validated in the caller's thread (so a server can answer 400 at once); everything
that touches the engine's state happens on the engine thread.  When a stream's consumer goes
away (a client disconnects: the async generator is closed or cancelled), the request is
aborted and its blocks return to the pool.  If a step raises, every unfinished request ends
with finish_reason "error" and the message, and the loop carries on: nothing is lost silently.

``on_step`` (optional, ``fn(stats)``) is called on the engine thread after each step with the
fresh :meth:`stats` snapshot, before the next requests are taken in: a live view can follow
every step, and a test can hold the engine at a known step (the engine waits while it runs).
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable

from workbench.engine.types import StreamEvent
from workbench.errors import ConfigError
from workbench.engine.sampling import SamplingParams
from workbench.engine.core import LLMEngine, describe_error as _describe


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05, liveness_check_s: float = 1.0,
                 on_step: Callable[[dict], None] | None = None) -> None:
        self.engine = engine
        self.on_step = on_step                     # fn(stats) on the engine thread after each step
        self.idle_wait_s = idle_wait_s
        self.liveness_check_s = liveness_check_s   # how often a waiting stream() checks the engine thread
        self._inbox: deque = deque()
        self._callbacks: dict[str, Callable[[StreamEvent], None]] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._started = False                      # start() was called (and stop() not since)
        self._stop = False
        self._ids = itertools.count()
        self._stats: dict = engine.stats()
        self.last_error: str | None = None
        self._seen_step_error: BaseException | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> AsyncEngine:
        if self._thread is None:
            self._stop = False
            self._started = True
            self._thread = threading.Thread(target=self._loop, name="workbench-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the engine thread; every request not finished yet ends with finish_reason "error"."""
        with self._cv:
            self._stop = True
            self._started = False
            self._cv.notify()
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
        if thread is None or not thread.is_alive():
            self._fail_callbacks(self._stopped_message())   # the thread did this unless it died or never ran
        self._thread = None

    @property
    def alive(self) -> bool:
        """Whether the engine thread runs."""
        return self._thread is not None and self._thread.is_alive()

    def _dead(self) -> bool:
        """start() was called but the engine thread is not running (it died, or stop() was called)."""
        with self._cv:
            return self._stop or (self._started and not self.alive)

    def _stopped_message(self) -> str:
        why = "the engine was stopped" if self._stop else "the engine thread is not running"
        return why + (f" (last error: {self.last_error})" if self.last_error else "")

    def __enter__(self) -> AsyncEngine:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- requests (any thread) -------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams, on_event: Callable[[StreamEvent], None], priority: int = 0,
               request_id: str | None = None, fork_of: str | None = None) -> str:
        """Queue a request; ``on_event`` is called on the engine thread for each of its events.
        Raises WorkbenchError (in the caller's thread) for invalid input, a request id in use, or
        when the engine thread is not running any more (before start(), requests wait for it).

        ``fork_of``: another sample of that request's prompt (parallel sampling; see
        :meth:`LLMEngine.add_request`), submitted after it.  The engine thread may take the
        parent in before the fork and run it, even to its end and release: a fork whose parent
        is no longer a live request that has not sampled yet is queued as any request (it
        computes the prompt itself) rather than failing on that race.  A fork whose prompt
        differs from its live parent's ends with an error event (ConfigError's message)."""
        self.engine.llm.encode(prompt)                 # validate now: the caller can answer 400
        arrival = self.engine.clock()
        with self._cv:
            if self._stop or (self._started and not self.alive):
                raise ConfigError(f"cannot submit: {self._stopped_message()}")
            rid = request_id or f"req-{next(self._ids)}"
            if rid in self._callbacks or rid in self.engine.seqs:
                raise ConfigError(f"request id {rid!r} is already in use")
            self._callbacks[rid] = on_event
            self._inbox.append(("add", rid, prompt, params, priority, arrival, fork_of))
            self._cv.notify()
        return rid

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    async def stream(self, prompt, params: SamplingParams, priority: int = 0,
                     request_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """Async iterator over one request's events; closing it early aborts the request.  If the
        engine thread stops or dies first, the last event has finish_reason "error"."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rid = self.submit(prompt, params, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev),
                          priority, request_id)
        done = False
        try:
            while True:
                try:
                    ev = await asyncio.wait_for(queue.get(), timeout=self.liveness_check_s)
                except TimeoutError:
                    if not self._dead():
                        continue
                    with self._cv:
                        self._callbacks.pop(rid, None)
                    now = self.engine.clock()
                    ev = StreamEvent(rid, 0, -1, "", now, 0.0, True, "error", self._stopped_message())
                yield ev
                if ev.finished:
                    done = True
                    return
        finally:
            if not done:
                self.abort(rid)

    def stats(self) -> dict:
        """The engine's last snapshot (refreshed by the engine thread after each step)."""
        return dict(self._stats)

    # ---- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        while True:
            with self._cv:
                while not self._stop and not self._inbox and not eng.has_unfinished():
                    self._cv.wait(self.idle_wait_s)
                if self._stop:
                    break
                inbox, self._inbox = self._inbox, deque()
            try:
                self._turn(inbox)
            except Exception as e:  # noqa: BLE001 - whatever fails ends its requests, never the loop
                self._failed(e)
        try:
            self._shutdown()
        except Exception as e:  # noqa: BLE001
            self.last_error = _describe(e)

    def _turn(self, inbox) -> None:
        eng = self.engine
        for item in inbox:
            self._apply(item)
        if not eng.has_unfinished():
            return
        try:
            events = eng.step()
        except Exception as e:  # noqa: BLE001 - a failed step must end its requests, not the server
            self._failed(e)
            return
        for ev in events:
            self._deliver(ev)
        err = eng.last_step_error              # a step the engine isolated: its requests ended, it went on
        if err is not None and err is not self._seen_step_error:
            self._seen_step_error = err
            self.last_error = f"a step failed (its requests ended with it): {_describe(err)}"
        self._stats = eng.stats()
        hook = self.on_step
        if hook is not None:
            try:
                hook(dict(self._stats))
            except Exception as e:  # noqa: BLE001 - a broken observer must not stop the engine
                self.last_error = f"on_step hook failed: {_describe(e)}"
        rec = eng.step_records[-1] if eng.step_records else None
        if rec is not None and rec.num_seqs == 0 and eng.scheduler.waiting:
            time.sleep(min(0.001, eng.scheduler.config.micro_batch_window_s or 0.001))  # window not open yet

    def _failed(self, e: BaseException) -> None:
        """After a failure on the engine thread: end every unfinished request with the message."""
        self.last_error = _describe(e)
        try:
            events = self._fail_all(self.last_error)
        except Exception as e2:  # noqa: BLE001 - the engine's state is broken: at least answer the callers
            self.last_error += f"; then failing the requests raised {_describe(e2)}"
            events = []
        for ev in events:
            try:
                self._deliver(ev)
            except Exception:  # noqa: BLE001
                pass
        try:
            self._stats = self.engine.stats()
        except Exception:  # noqa: BLE001
            pass

    def _apply(self, item) -> None:
        eng = self.engine
        if item[0] == "add":
            _, rid, prompt, params, priority, arrival, *fork = item   # submit adds fork_of; an item without it
            fork_of = fork[0] if fork else None                         # (built by hand) is a plain request
            parent = eng.seqs.get(fork_of)
            if parent is None or parent.finished or parent.num_generated:
                fork_of = None               # too late to share the parent's prompt: compute it (docstring of submit)
            try:
                extra = {"fork_of": fork_of} if fork_of else {}     # a wrapped add_request may not know forks
                eng.add_request(prompt, params, request_id=rid, priority=priority, arrival_time=arrival, **extra)
            except Exception as e:  # noqa: BLE001 - validated already; report anything else to its caller
                # the id may belong to a request this one must not touch: answer the caller only
                self._deliver(StreamEvent(rid, 0, -1, "", eng.clock(), 0.0, True, "error", str(e)), release=False)
        elif item[0] == "abort":
            eng.abort(item[1], "the client went away")

    def _deliver(self, ev: StreamEvent, release: bool = True) -> None:
        if ev.finished:
            with self._cv:
                cb = self._callbacks.pop(ev.request_id, None)
        else:
            cb = self._callbacks.get(ev.request_id)
        if cb is not None:
            try:
                cb(ev)
            except Exception:  # noqa: BLE001 - a broken consumer must not stop the engine
                pass
        if ev.finished and release:
            seq = self.engine.seqs.get(ev.request_id)
            if seq is not None and seq.finished:
                self.engine.release(ev.request_id)

    def _fail_all(self, message: str) -> list[StreamEvent]:
        eng = self.engine
        for rid, seq in list(eng.seqs.items()):
            if not seq.finished:
                eng.fail(rid, message)
        return eng.drain_events()

    def _shutdown(self) -> None:
        """On stop: requests still queued or running end with finish_reason "error"."""
        message = self._stopped_message()
        with self._cv:
            inbox, self._inbox = self._inbox, deque()
        for item in inbox:
            if item[0] == "add":
                now = self.engine.clock()
                self._deliver(StreamEvent(item[1], 0, -1, "", now, 0.0, True, "error", message), release=False)
        try:
            events = self._fail_all(message)
        except Exception as e:  # noqa: BLE001
            self.last_error = _describe(e)
            events = []
        for ev in events:
            self._deliver(ev)
        self._stats = self.engine.stats()
        self._fail_callbacks(message)

    def _fail_callbacks(self, message: str) -> None:
        """Every caller still waiting gets a final error event (the engine thread is gone)."""
        with self._cv:
            pending, self._callbacks = self._callbacks, {}
        now = self.engine.clock()
        for rid, cb in pending.items():
            try:
                cb(StreamEvent(rid, 0, -1, "", now, 0.0, True, "error", message))
            except Exception:  # noqa: BLE001
                pass

