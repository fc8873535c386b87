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
"""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
import traceback
from collections import deque
from typing import AsyncIterator, Callable

from ..engine_types import StreamEvent
from ..sampling import SamplingParams
from .engine import LLMEngine


class AsyncEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.idle_wait_s = idle_wait_s
        self._inbox: deque = deque()
        self._callbacks: dict[str, Callable[[StreamEvent], None]] = {}
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stop = False
        self._ids = itertools.count()
        self._stats: dict = engine.stats()
        self.last_error: str | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> "AsyncEngine":
        if self._thread is None:
            self._stop = False
            self._thread = threading.Thread(target=self._loop, name="workbench-engine", daemon=True)
            self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> "AsyncEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- requests (any thread) -------------------------------------------------------------------
    def submit(self, prompt, params: SamplingParams, on_event: Callable[[StreamEvent], None], priority: int = 0,
               request_id: str | None = None) -> str:
        """Queue a request; ``on_event`` is called on the engine thread for each of its events.
        Raises WorkbenchError (in the caller's thread) for invalid input."""
        self.engine.llm.encode(prompt)                 # validate now: the caller can answer 400
        rid = request_id or f"req-{next(self._ids)}"
        arrival = self.engine.clock()
        with self._cv:
            self._callbacks[rid] = on_event
            self._inbox.append(("add", rid, prompt, params, priority, arrival))
            self._cv.notify()
        return rid

    def abort(self, request_id: str) -> None:
        with self._cv:
            self._inbox.append(("abort", request_id))
            self._cv.notify()

    async def stream(self, prompt, params: SamplingParams, priority: int = 0,
                     request_id: str | None = None) -> AsyncIterator[StreamEvent]:
        """Async iterator over one request's events; closing it early aborts the request."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        rid = self.submit(prompt, params, lambda ev: loop.call_soon_threadsafe(queue.put_nowait, ev),
                          priority, request_id)
        done = False
        try:
            while True:
                ev = await queue.get()
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
            for item in inbox:
                self._apply(item)
            if not eng.has_unfinished():
                continue
            try:
                events = eng.step()
            except Exception as e:  # noqa: BLE001 - a failed step must end its requests, not the server
                self.last_error = "".join(traceback.format_exception_only(type(e), e)).strip()
                events = self._fail_all(self.last_error)
            for ev in events:
                self._deliver(ev)
            self._stats = eng.stats()
            rec = eng.step_records[-1] if eng.step_records else None
            if rec is not None and rec.num_seqs == 0 and eng.scheduler.waiting:
                time.sleep(min(0.001, eng.config.micro_batch_window_s or 0.001))  # window not open yet

    def _apply(self, item) -> None:
        eng = self.engine
        if item[0] == "add":
            _, rid, prompt, params, priority, arrival = item
            try:
                eng.add_request(prompt, params, request_id=rid, priority=priority, arrival_time=arrival)
            except Exception as e:  # noqa: BLE001 - validated already; report anything else to its caller
                self._deliver(StreamEvent(rid, 0, -1, "", eng.clock(), 0.0, True, "error", str(e)))
        elif item[0] == "abort":
            eng.abort(item[1], "the client went away")

    def _deliver(self, ev: StreamEvent) -> None:
        cb = self._callbacks.get(ev.request_id)
        if cb is not None:
            try:
                cb(ev)
            except Exception:  # noqa: BLE001 - a broken consumer must not stop the engine
                pass
        if ev.finished:
            self._callbacks.pop(ev.request_id, None)
            if ev.request_id in self.engine.seqs:
                self.engine.release(ev.request_id)

    def _fail_all(self, message: str) -> list[StreamEvent]:
        eng = self.engine
        for rid, seq in list(eng.seqs.items()):
            if not seq.finished:
                eng.fail(rid, message)
        return eng.drain_events()
