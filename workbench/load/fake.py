"""A fake in-process "model" for load tests and demos: asyncio sleeps, a fixed capacity.

``FakeTarget`` behaves like a small continuous-batching server without doing any work:

* ``capacity`` requests run at once; the rest wait in a FIFO queue, so TTFT grows with load
  (queueing counts in TTFT, as a user sees it);
* a running request "prefills" for ``ttft_s`` and then streams ``max_tokens`` tokens,
  ``token_delay_s`` apart;
* ``slowdown`` makes both grow with the batch: each delay is multiplied by
  ``1 + slowdown * (running - 1)`` - the way a decode step slows as the batch fills, or a
  nearly full KV pool degrades latency while no request fails;
* ``max_queue``: a request that finds that many already waiting is rejected (like a 429);
* ``error_every``: every n-th request fails after its first token (for error accounting).

``metrics()`` reports queue_len / running / batch_size / kv_usage for live views.
``clock`` stamps the token events (default ``time.perf_counter``); with the event loop's
``loop.time`` on a virtual-time loop a whole load run is scripted exactly (no waiting).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable

from workbench.errors import ConfigError
from workbench.load.target import Prompt, TokenEvent


class FakeTarget:
    def __init__(self, ttft_s: float = 0.02, token_delay_s: float = 0.01, capacity: int = 4,
                 slowdown: float = 0.0, max_queue: int | None = None, error_every: int | None = None,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        for name, v in (("ttft_s", ttft_s), ("token_delay_s", token_delay_s), ("slowdown", slowdown)):
            if not v >= 0:
                raise ConfigError(f"FakeTarget.{name}={v!r} must be >= 0")
        if not (isinstance(capacity, int) and capacity >= 1):
            raise ConfigError(f"FakeTarget.capacity={capacity!r} must be an integer >= 1")
        self.ttft_s, self.token_delay_s, self.capacity = ttft_s, token_delay_s, capacity
        self.slowdown, self.max_queue, self.error_every = slowdown, max_queue, error_every
        self.clock = clock
        self.running = 0
        self.waiting = 0
        self.max_running = 0          # the most ever running at once (never above capacity)
        self.served = 0
        self.priorities: list[int] = []
        self._ids = itertools.count(1)
        self._sems: dict = {}         # event loop -> its semaphore (asyncio primitives bind to one loop)

    def _sem(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._sems:
            self._sems = {lp: s for lp, s in self._sems.items() if not lp.is_closed()}
            self._sems[loop] = asyncio.Semaphore(self.capacity)
        return self._sems[loop]

    def _scale(self) -> float:
        return 1.0 + self.slowdown * max(0, self.running - 1)

    async def send(self, prompt: Prompt, max_tokens: int, priority: int = 0, **sampling) -> AsyncIterator[TokenEvent]:
        n = next(self._ids)
        self.priorities.append(priority)
        if self.max_queue is not None and self.waiting >= self.max_queue:
            yield TokenEvent(self.clock(), finished=True, finish_reason="rejected", rejected=True,
                             error=f"queue full ({self.waiting} waiting, max_queue={self.max_queue})", tokens=0)
            return
        sem = self._sem()
        self.waiting += 1
        try:
            await sem.acquire()
        finally:
            self.waiting -= 1
        self.running += 1
        self.max_running = max(self.max_running, self.running)
        try:
            await asyncio.sleep(self.ttft_s * self._scale())
            for i in range(max_tokens):
                if i:
                    await asyncio.sleep(self.token_delay_s * self._scale())
                last = i == max_tokens - 1
                yield TokenEvent(self.clock(), text=f" t{i}", token_id=i, finished=last,
                                 finish_reason="length" if last else None)
                if i == 0 and self.error_every and n % self.error_every == 0:
                    yield TokenEvent(self.clock(), finished=True, error="injected failure", tokens=0)
                    return
            self.served += 1
        finally:
            self.running -= 1
            sem.release()

    def metrics(self) -> dict:
        return {"queue_len": self.waiting, "running": self.running, "batch_size": self.running,
                "kv_usage": self.running / self.capacity}
