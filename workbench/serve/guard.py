"""The server's side of an SLO guard (a latency circuit breaker such as
:class:`workbench.serve.slo.SLOGuard`): ask it before a request reaches the engine, tell it each
request's time to first token.

The guard is duck-typed, so a scripted one works as well as the real one::

    guard.admit(now=None, priority=0) -> decision     # decision.admit (or .admitted): bool,
                                                     # .reason: str | None, .retry_after: float | None,
                                                     # .probe: bool (optional: admitted as a half-open probe)
    guard.record(ttft_s)                              # seconds; also given probe=... when it takes that keyword
    guard.snapshot() -> dict                          # optional: state and numbers, exported on /metrics
    guard.config.policy, guard.config.queue_timeout_s # optional: "queue" holds deferred requests (SLOConfig)

The server calls ``admit(priority=<x-priority>)`` after a request has been validated (a bad
request is a 400, never a shed) and answers a refusal with ``503`` naming the guard's reason
and a ``Retry-After`` header.  With the queue policy (``guard.config.policy == "queue"``) a
refusal that carries ``retry_after`` ("ask again then") is not answered at once: the server
holds the request, sleeping ``retry_after`` and asking ``admit`` again, until it is admitted
(then it is served as usual) or ``guard.config.queue_timeout_s`` has passed since the first refusal
(then the 503, saying so); a client that disconnects while held is dropped before anything
reaches the engine.  It calls ``record(ttft)`` once per admitted request, when its
first token arrives, with the TTFT measured from arrival at the engine (queueing included: that
is where a full KV pool shows).  A request admitted as a probe that ends before its first
token is recorded as ``math.inf`` (a failed probe), as :class:`~workbench.serve.slo.GuardedTarget`
does.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

from workbench.errors import ConfigError


@dataclass
class Admission:
    admitted: bool
    reason: str | None = None
    retry_after: float | None = None   # seconds, as the guard said (None: it did not say)
    probe: bool = False


def check_guard(guard) -> None:
    """Raise ConfigError unless ``guard`` has callable ``admit`` and ``record``."""
    missing = [m for m in ("admit", "record") if not callable(getattr(guard, m, None))]
    if missing:
        raise ConfigError(f"SLO guard {type(guard).__name__}: needs callable {' and '.join(missing)} "
                          "(admit(now=None, priority=0) -> decision, record(ttft_s)); "
                          "see workbench.serve.slo.SLOGuard")


class GuardHook:
    """Wraps a duck-typed guard for the server (one instance per app)."""

    def __init__(self, guard) -> None:
        check_guard(guard)
        self.guard = guard
        try:
            params = inspect.signature(guard.record).parameters
            self._takes_probe = "probe" in params or any(p.kind is p.VAR_KEYWORD for p in params.values())
        except (TypeError, ValueError):
            self._takes_probe = False

    def admit(self, priority: int) -> Admission:
        d = self.guard.admit(priority=priority)
        ok = getattr(d, "admitted", None)
        if ok is None:
            ok = getattr(d, "admit", None)
        if not isinstance(ok, bool):
            raise TypeError(f"{type(self.guard).__name__}.admit() returned {d!r}: expected an object with a "
                            "boolean 'admit' (or 'admitted') field")
        retry = getattr(d, "retry_after", None)
        return Admission(ok, getattr(d, "reason", None), None if retry is None else float(retry),
                         bool(getattr(d, "probe", False)))

    def record(self, ttft_s: float, probe: bool) -> None:
        if self._takes_probe:
            self.guard.record(ttft_s, probe=probe)
        else:
            self.guard.record(ttft_s)

    def failed_probe(self) -> None:
        self.record(math.inf, True)

    def queue_timeout_s(self) -> float | None:
        """How long to hold a request the guard defers (seconds): its ``config.queue_timeout_s``
        when ``config.policy == "queue"`` (read at every request, so a changed config applies to
        the next one); None: no queue, refusals are answered at once."""
        cfg = getattr(self.guard, "config", None)
        if getattr(cfg, "policy", None) != "queue":
            return None
        t = getattr(cfg, "queue_timeout_s", None)
        try:
            t = float(t)
        except (TypeError, ValueError):
            return None
        return t if t > 0 else None             # inf: hold until admitted or the client leaves

    def retry_after_s(self, a: Admission) -> int:
        """Whole seconds for the Retry-After header (at least 1): the guard's own figure, else the
        rest of an SLOGuard-style cool-down, else 1."""
        wait = a.retry_after
        if wait is None:
            g = self.guard
            try:
                snap = g.snapshot()
                opened, cooldown = snap.get("opened_at"), getattr(getattr(g, "config", None), "cooldown_s", None)
                if opened is not None and cooldown is not None and callable(getattr(g, "clock", None)):
                    wait = opened + cooldown - g.clock()
            except Exception:  # noqa: BLE001 - a header estimate must not fail the response
                wait = None
        if wait is None or not math.isfinite(wait):
            return 1
        return max(1, math.ceil(wait))

    def snapshot(self) -> dict:
        """The guard's state for /metrics ({} when it has no snapshot(); {"error": ...} if that fails)."""
        snap = getattr(self.guard, "snapshot", None)
        if callable(snap):
            try:
                return dict(snap())
            except Exception as e:  # noqa: BLE001 - a scrape must not fail on the guard
                return {"error": f"{type(e).__name__}: {e}"}
        state = getattr(self.guard, "state", None)
        return {"state": state} if isinstance(state, str) else {}

    def describe(self) -> dict:
        out = {"type": type(self.guard).__name__}
        desc = getattr(self.guard, "describe", None)
        if callable(desc):
            try:
                out["config"] = desc()
            except Exception as e:  # noqa: BLE001
                out["config_error"] = f"{type(e).__name__}: {e}"
        return out
