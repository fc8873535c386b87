"""An asyncio event loop on a virtual clock, for load tests that must not depend on the machine.

``loop.time()`` is a number that only moves when the loop would otherwise sleep: whenever
nothing is ready to run, the clock jumps straight to the next timer.  Code that runs takes no
time at all, so a scripted load against :class:`~workbench.load.FakeTarget` (whose latencies
are ``asyncio.sleep`` s) gives the same timestamps, queues and counts on every machine, loaded
or not, and a second of load takes milliseconds.  Pass ``vt.clock`` (the loop's ``time``)
wherever the code under test reads a clock::

    with VirtualTime() as vt:
        target = FakeTarget(clock=vt.clock)
        run = LoadRun(target, cfg, clock=vt.clock)
        res = vt.run(run.arun())

I/O still works (the loop polls its selector without waiting first); only when no timer is
pending does it block for real, up to ``idle_limit_s``.  Work handed in from another thread
(``call_soon_threadsafe``) is seen, but virtual time does not wait for it: while a timer is
pending the clock jumps ahead regardless.  So use it with pure-asyncio fakes (FakeTarget), not
with a target that computes on its own thread.
"""

from __future__ import annotations

import asyncio
import selectors


class _Selector(selectors.DefaultSelector):
    def __init__(self, idle_limit_s: float) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None
        self.idle_limit_s = idle_limit_s

    def select(self, timeout=None):
        ready = super().select(0)                       # whatever is ready now (I/O, call_soon_threadsafe)
        if ready or (timeout is not None and timeout <= 0):
            return ready
        if timeout is None:                             # no timer at all: only I/O or a thread can wake us
            ready = super().select(self.idle_limit_s)
            if not ready:
                raise RuntimeError(f"virtual-time loop: no timer and no I/O for {self.idle_limit_s} s "
                                   "(nothing can ever wake it: a deadlock in the test?)")
            return ready
        self.loop.advance(timeout)                      # sleep in virtual time: jump to the next timer
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, start: float = 0.0, idle_limit_s: float = 60.0) -> None:
        selector = _Selector(idle_limit_s)
        super().__init__(selector)
        selector.loop = self
        self._virtual_now = float(start)

    def time(self) -> float:
        return self._virtual_now

    def advance(self, seconds: float) -> None:
        self._virtual_now += max(0.0, seconds)


class VirtualTime:
    """A context manager around an :class:`asyncio.Runner` on a :class:`VirtualTimeLoop`:
    ``clock`` (the loop's time, for the code under test) and ``run(coro)``."""

    def __init__(self, start: float = 0.0) -> None:
        self._runner = asyncio.Runner(loop_factory=lambda: VirtualTimeLoop(start))

    def __enter__(self) -> VirtualTime:
        self._runner.__enter__()
        self.loop = self._runner.get_loop()
        self.clock = self.loop.time
        return self

    def __exit__(self, *exc) -> None:
        self._runner.__exit__(*exc)

    def run(self, coro):
        return self._runner.run(coro)
