"""An SLO guard: a circuit breaker on *latency*, for when nothing fails but everything is slow.

A full KV pool or an overfull batch does not make requests fail; it makes them wait.  An
error-counting breaker never trips then.  This one watches TTFT instead::

             P95(window) > factor x baseline              cool-down elapsed
    CLOSED ------------------------------------> OPEN -----------------------> HALF_OPEN
      ^        (at least min_samples samples)     ^                               |
      |                                           +--- probes unhealthy ----------+
      +--------------------- probes healthy ---------------------------------------+

* **baseline**: an EWMA of the window's P95 TTFT, learned online and only while CLOSED and
  healthy (P95 <= ``learn_factor`` x baseline), so a slow period never becomes the norm.
  The first ``min_samples`` samples seed it (or give ``baseline_s``).
* **OPEN** sheds load: ``admit`` says no, with the reason (``policy="reject"``), or says
  "wait ``retry_after`` seconds" (``policy="queue"``; :class:`GuardedTarget` then holds the
  request up to ``queue_timeout_s``).  Priorities in ``bypass_priorities`` are admitted anyway.
* **HALF_OPEN** admits ``probes`` requests; when their TTFTs are in, the P95 of the probes
  decides: healthy -> CLOSED (window restarts from the probes), else OPEN again.
* Stale evidence is ignored: results that arrive while OPEN, non-probe results in HALF_OPEN,
  and (given ``admitted_at``) results of requests admitted before the guard last opened -
  they queued through the overload the probes have since ruled on - probes of an earlier
  half-open cycle included.

Pure Python and deterministic: every method takes ``now`` (seconds; default the injected
``clock``), so a scripted trace replays exactly.  Every public method holds a lock, which makes
reads from another thread (a metrics poller) safe.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from collections.abc import AsyncIterator, Callable

import numpy as np

from workbench.errors import ConfigError, WorkbenchError
from workbench.load.target import Prompt, TokenEvent

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
POLICIES = ("reject", "queue")


def ewma_step(baseline: float | None, p95: float, samples: int, alpha: float, factor: float, learn_factor: float,
              min_samples: int, min_threshold: float) -> tuple[float | None, bool]:
    """One TTFT sample's effect on a CLOSED guard: ``(baseline after it, whether the guard trips)``.

    ``p95``: the window's P95 TTFT (seconds) with the sample in it; ``samples``: TTFTs in the
    window.  Until ``min_samples`` are in, nothing happens; the first full window's P95 seeds the
    baseline; the guard trips when the P95 exceeds ``max(factor x baseline, min_threshold)``
    (strictly: a P95 exactly at the bound does not trip), leaving the baseline as it was; a P95
    at most ``learn_factor x baseline`` is healthy and the baseline learns it by EWMA,
    ``baseline + alpha (p95 - baseline)`` (``alpha * p95 + (1 - alpha) * baseline``); between
    the two it is neither: a slow period does not become the norm."""
    if samples < min_samples:
        return baseline, False
    if baseline is None:
        return p95, False
    if p95 > max(factor * baseline, min_threshold):
        return baseline, True
    if p95 <= learn_factor * baseline:
        return baseline + alpha * (p95 - baseline), False
    return baseline, False


@dataclass
class SLOConfig:
    factor: float = 2.0            # open when P95 TTFT > factor x baseline
    quantile: float = 0.95
    window: int = 50               # the sliding window: this many most recent TTFTs
    min_samples: int = 20          # samples needed in the window before it may open (and to seed the baseline)
    ewma_alpha: float = 0.05       # baseline <- (1 - a) baseline + a P95, per healthy sample
    learn_factor: float = 1.25     # healthy (the baseline learns) while P95 <= learn_factor x baseline
    baseline_s: float | None = None   # a known baseline TTFT P95 (seconds); None: learn it
    min_threshold_s: float = 0.0   # never open below this P95 (seconds): ignores noise at tiny TTFTs
    cooldown_s: float = 5.0        # OPEN for this long, then HALF_OPEN
    probes: int = 5                # requests admitted in HALF_OPEN; their P95 decides
    probe_timeout_s: float | None = None   # a probe with no TTFT by then frees its slot (None: cooldown_s)
    policy: str = "reject"         # OPEN sheds by "reject" or "queue"
    queue_timeout_s: float = 10.0  # policy="queue": how long GuardedTarget holds a request at most
    bypass_priorities: tuple = ()  # priorities admitted even while OPEN (e.g. (1,) for "interactive")
    # the breaker's step: None for the package's (ewma_step), or a function with its parameters
    # (notebook 04's exercise 04.breaker); an invalid answer is a one-line WorkbenchError
    update: Callable | None = None

    def __post_init__(self) -> None:
        def bad(name, why):
            raise ConfigError(f"SLOConfig.{name}={getattr(self, name)!r} {why}")

        if not (self.factor > 1 and math.isfinite(self.factor)):
            bad("factor", "must be a finite number > 1 (open when P95 > factor x baseline)")
        if not 0 < self.quantile < 1:
            bad("quantile", "must be in (0, 1), e.g. 0.95")
        if not (isinstance(self.window, int) and self.window >= 1):
            bad("window", "must be an integer >= 1 (samples)")
        if not (isinstance(self.min_samples, int) and 1 <= self.min_samples <= self.window):
            bad("min_samples", f"must be an integer in [1, window={self.window}]")
        if not 0 < self.ewma_alpha <= 1:
            bad("ewma_alpha", "must be in (0, 1]")
        if not 1 <= self.learn_factor <= self.factor:
            bad("learn_factor", f"must be in [1, factor={self.factor}]")
        if self.baseline_s is not None and not self.baseline_s > 0:
            bad("baseline_s", "must be > 0 seconds or None (learn it)")
        if not self.min_threshold_s >= 0:
            bad("min_threshold_s", "must be >= 0 seconds")
        if not self.cooldown_s > 0:
            bad("cooldown_s", "must be > 0 seconds")
        if not (isinstance(self.probes, int) and self.probes >= 1):
            bad("probes", "must be an integer >= 1")
        if self.probe_timeout_s is not None and not self.probe_timeout_s > 0:
            bad("probe_timeout_s", "must be > 0 seconds or None")
        if self.policy not in POLICIES:
            bad("policy", f"must be one of {POLICIES}")
        if not self.queue_timeout_s >= 0:
            bad("queue_timeout_s", "must be >= 0 seconds")
        try:
            self.bypass_priorities = tuple(int(p) for p in self.bypass_priorities)
        except (TypeError, ValueError):
            bad("bypass_priorities", "must be a tuple of integer priorities")
        if self.update is not None and not callable(self.update):
            bad("update", "must be None (the package's ewma_step) or a function with ewma_step's parameters")


@dataclass
class Decision:
    admit: bool
    reason: str | None = None
    state: str = CLOSED
    probe: bool = False                 # admitted as a HALF_OPEN probe
    retry_after: float | None = None    # policy="queue": ask again after this many seconds


@dataclass
class SLOGuard:
    """``guard.admit(now, priority) -> Decision``, ``guard.record(ttft_s, now)``, ``guard.state``,
    ``guard.snapshot()``; ``transitions`` logs (time, from, to, why)."""
    config: SLOConfig = field(default_factory=SLOConfig)
    clock: Callable[[], float] = time.perf_counter

    def __post_init__(self) -> None:
        c = self.config
        self._state = CLOSED
        self.window: deque[float] = deque(maxlen=c.window)
        self.baseline: float | None = c.baseline_s
        self.opened_at: float | None = None
        self.open_reason: str | None = None
        self._probe_issued: deque[float] = deque()   # issue times of probes awaiting their TTFT
        self._probe_results: list[float] = []
        self.transitions: list[tuple[float, str, str, str]] = []
        # per admit() call: admitted, rejected, deferred ("ask again": policy="queue"), ...
        self.counts = {"admitted": 0, "rejected": 0, "deferred": 0, "bypassed": 0, "probes": 0, "samples": 0,
                       "stale": 0}
        self.last_opened_at: float | None = None   # kept after closing: older admissions are stale evidence
        self._lock = threading.RLock()

    # ---- the state machine ----------------------------------------------------------------------
    def _now(self, now: float | None) -> float:
        return self.clock() if now is None else now

    def _go(self, state: str, now: float, why: str) -> None:
        self.transitions.append((now, self._state, state, why))
        self._state = state
        if state == OPEN:
            self.opened_at, self.open_reason = now, why
            self.last_opened_at = now
            self.window.clear()
        elif state == HALF_OPEN:
            self._probe_issued.clear()
            self._probe_results = []
        else:
            self.opened_at = self.open_reason = None

    def _advance(self, now: float) -> None:
        c = self.config
        if self._state == OPEN and now - self.opened_at >= c.cooldown_s:
            self._go(HALF_OPEN, now, f"cool-down of {c.cooldown_s:g} s elapsed: probing")
        if self._state == HALF_OPEN:   # probes that never reported free their slots
            timeout = c.probe_timeout_s or c.cooldown_s
            while self._probe_issued and now - self._probe_issued[0] > timeout:
                self._probe_issued.popleft()

    @property
    def state(self) -> str:
        return self.state_at(self.clock())

    def state_at(self, now: float) -> str:
        with self._lock:
            self._advance(now)
            return self._state

    @property
    def threshold(self) -> float | None:
        """The P95 TTFT (seconds) above which the guard opens; None while learning."""
        if self.baseline is None:
            return None
        return max(self.config.factor * self.baseline, self.config.min_threshold_s)

    def p95(self) -> float | None:
        return float(np.quantile(list(self.window), self.config.quantile)) if self.window else None

    # ---- the two calls ----------------------------------------------------------------------------
    def admit(self, now: float | None = None, priority: int = 0) -> Decision:
        with self._lock:
            return self._admit(self._now(now), priority)

    def _admit(self, now: float, priority: int) -> Decision:
        self._advance(now)
        c = self.config
        if self._state == CLOSED:
            self.counts["admitted"] += 1
            return Decision(True, state=CLOSED)
        if priority in c.bypass_priorities:
            self.counts["admitted"] += 1
            self.counts["bypassed"] += 1
            return Decision(True, reason=f"priority {priority} bypasses the open SLO guard", state=self._state)
        if self._state == HALF_OPEN and len(self._probe_issued) + len(self._probe_results) < c.probes:
            self._probe_issued.append(now)
            self.counts["admitted"] += 1
            self.counts["probes"] += 1
            return Decision(True, reason="probe", state=HALF_OPEN, probe=True)
        if self._state == OPEN:
            wait = self.opened_at + c.cooldown_s - now
            why = f"SLO guard open: {self.open_reason}"     # (no countdown in it: reasons group in reports)
        else:
            wait = c.cooldown_s / 20
            why = f"SLO guard half-open: {c.probes} probes in flight, waiting for their TTFT"
        if c.policy == "queue":
            self.counts["deferred"] += 1
            return Decision(False, reason=why, state=self._state, retry_after=max(wait, 1e-3))
        self.counts["rejected"] += 1
        return Decision(False, reason=why, state=self._state)

    def record(self, ttft_s: float, now: float | None = None, probe: bool | None = None,
               admitted_at: float | None = None) -> str:
        """Feed one request's TTFT (seconds; ``math.inf`` for a probe that failed).  ``probe``:
        whether the request was admitted as a probe (from its Decision); None = unknown, taken
        as a probe in HALF_OPEN.  ``admitted_at``: when it was admitted (same clock); a
        request admitted before the guard last opened is stale evidence - a non-probe waited
        through the overload the probes have since ruled over, a probe belongs to an earlier
        half-open cycle that has been decided - and is ignored (counted as ``stale``; a stale
        probe frees no probe slot of the current cycle).
        Returns the state after it."""
        with self._lock:
            return self._record(ttft_s, self._now(now), probe, admitted_at)

    def _record(self, ttft_s: float, now: float, probe: bool | None, admitted_at: float | None = None) -> str:
        self._advance(now)
        c = self.config
        self.counts["samples"] += 1
        if admitted_at is not None and self.last_opened_at is not None and (
                admitted_at < self.last_opened_at
                or (probe is not False and admitted_at <= self.last_opened_at)):
            # admitted before the guard last opened: a non-probe that queued through the overload,
            # or a late probe of an earlier half-open cycle (this cycle's probes are admitted a
            # cool-down after the opening).  Not evidence now, and it frees no slot of this cycle.
            self.counts["stale"] += 1
            return self._state
        if self._state == HALF_OPEN:
            if probe is False:
                return self._state         # a request admitted before the guard opened: stale evidence
            if self._probe_issued:
                self._probe_issued.popleft()
            self._probe_results.append(ttft_s)
            if len(self._probe_results) >= c.probes:
                p = float(np.quantile(np.minimum(self._probe_results, 1e9), c.quantile))   # inf: a failed probe
                if p <= self.threshold:
                    self._go(CLOSED, now, f"probe TTFT P{c.quantile * 100:g} {p * 1e3:.1f} ms <= "
                                          f"{self.threshold * 1e3:.1f} ms")
                    self.window.extend(self._probe_results)
                else:
                    failed = sum(1 for x in self._probe_results if not math.isfinite(x))
                    self._go(OPEN, now, f"{failed} of {len(self._probe_results)} probes failed before their first "
                                        "token" if failed else f"probe TTFT P{c.quantile * 100:g} {p * 1e3:.1f} ms > "
                                        f"threshold {self.threshold * 1e3:.1f} ms")
            return self._state
        if self._state == OPEN or not math.isfinite(ttft_s):
            return self._state             # late results of requests admitted earlier: not evidence now
        self.window.append(ttft_s)
        if len(self.window) < c.min_samples:
            return self._state
        p = self.p95()
        baseline, trips = self._step(p)
        if trips:
            self._go(OPEN, now, f"TTFT P{c.quantile * 100:g} {p * 1e3:.1f} ms > {c.factor:g} x baseline "
                                f"{self.baseline * 1e3:.1f} ms over {len(self.window)} requests")
        self.baseline = baseline
        return self._state

    def _step(self, p95: float) -> tuple[float, bool]:
        """:func:`ewma_step` (or ``config.update``) on the window's P95; an update's answer is
        checked before anything changes (a bad one is a one-line WorkbenchError)."""
        c = self.config
        kw = dict(baseline=self.baseline, p95=p95, samples=len(self.window), alpha=c.ewma_alpha, factor=c.factor,
                  learn_factor=c.learn_factor, min_samples=c.min_samples, min_threshold=c.min_threshold_s)
        if c.update is None:
            return ewma_step(**kw)
        try:
            got = c.update(**kw)
        except Exception as e:  # noqa: BLE001 - the learner's code: said in one line
            raise WorkbenchError(f"SLOConfig.update raised {type(e).__name__}: {e}") from None
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            raise WorkbenchError(f"SLOConfig.update must return (baseline, trips), got {got!r}")
        baseline, trips = got
        if isinstance(baseline, bool) or not isinstance(baseline, (int, float)) or not (
                math.isfinite(baseline) and baseline >= 0):
            raise WorkbenchError(f"SLOConfig.update returned baseline {baseline!r}: once {c.min_samples} samples are "
                                 "in, the baseline is a finite number of seconds >= 0")
        if not isinstance(trips, (bool, np.bool_)):
            raise WorkbenchError(f"SLOConfig.update returned trips={trips!r}: True or False")
        trips = bool(trips)
        if trips and self.baseline is None:
            raise WorkbenchError("SLOConfig.update tripped on the first full window: with no baseline yet there is "
                                 "nothing to compare with (the first P95 seeds the baseline)")
        return float(baseline), trips

    def snapshot(self, now: float | None = None) -> dict:
        """State and numbers for views and /metrics (times in seconds)."""
        with self._lock:
            self._advance(self._now(now))
            return {"state": self._state, "baseline_s": self.baseline, "threshold_s": self.threshold,
                    "p95_s": self.p95(), "window_samples": len(self.window), "opened_at": self.opened_at,
                    "open_reason": self.open_reason, "probes_pending": len(self._probe_issued),
                    "probe_results": len(self._probe_results),
                    "trips": sum(1 for t in self.transitions if t[2] == OPEN), **self.counts}

    def describe(self) -> dict:
        d = asdict(self.config)
        d["update"] = None if self.config.update is None else getattr(self.config.update, "__name__", "custom")
        return d



class GuardedTarget:
    """A target behind an :class:`SLOGuard`: refused requests are not sent; they end with one
    ``TokenEvent(rejected=True, error=reason)``.  Admitted requests report their TTFT
    (measured from admission, so time held in the guard's queue does not count against the
    server) to the guard; a probe that fails before its first token counts as unhealthy.
    ``clock``: what the queue's deadline and the TTFTs are measured with - the clock of the
    inner target's event times (default ``time.perf_counter``)."""

    def __init__(self, target, guard: SLOGuard, clock: Callable[[], float] = time.perf_counter) -> None:
        self.target, self.guard, self.clock = target, guard, clock

    async def send(self, prompt: Prompt, max_tokens: int, priority: int = 0, **sampling) -> AsyncIterator[TokenEvent]:
        import asyncio

        g, clock = self.guard, self.clock
        d = g.admit(priority=priority)
        if not d.admit and d.retry_after is not None:       # policy="queue": wait for the guard
            deadline = clock() + g.config.queue_timeout_s
            while not d.admit and clock() < deadline:
                await asyncio.sleep(min(d.retry_after, max(0.0, deadline - clock())))
                d = g.admit(priority=priority)
            if not d.admit:
                d.reason = f"{d.reason} (queued {g.config.queue_timeout_s:g} s, timed out)"
                with g._lock:
                    g.counts["rejected"] += 1
        if not d.admit:
            yield TokenEvent(clock(), finished=True, finish_reason="rejected", error=d.reason,
                             rejected=True, tokens=0)
            return
        t0 = clock()
        admitted_at = g.clock()
        seen_first = False
        async for ev in self.target.send(prompt, max_tokens, priority=priority, **sampling):
            if not seen_first and ev.tokens > 0 and ev.error is None:
                seen_first = True
                g.record(ev.time - t0, probe=d.probe, admitted_at=admitted_at)
            elif not seen_first and (ev.error is not None or ev.finished) and d.probe:
                g.record(math.inf, probe=True, admitted_at=admitted_at)
                seen_first = True
            yield ev

    def metrics(self) -> dict:
        inner = self.target.metrics() if hasattr(self.target, "metrics") else {}
        snap = self.guard.snapshot()
        return {**inner, "slo_state": snap["state"], "slo_rejected": snap["rejected"],
                "slo_p95_s": snap["p95_s"], "slo_threshold_s": snap["threshold_s"]}

    async def aclose(self) -> None:
        if hasattr(self.target, "aclose"):
            await self.target.aclose()
