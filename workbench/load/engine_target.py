"""The in-process target: the load generator talking to the batched engine without HTTP.

::

    from workbench.load import EngineTarget, LoadConfig, run_load_sync
    with EngineTarget.from_model(None, device="cpu") as target:       # the bundled model
        res = run_load_sync(target, LoadConfig(mode="poisson", rate=4, max_requests=20, max_tokens=16))
        target.engine.steps_frame()                                    # per-step records for the timeline

``EngineTarget(async_engine)`` wraps an :class:`~workbench.sched.AsyncEngine` (started if it is
not running; stopped by :meth:`close` only when this target started it).  Each ``send`` submits
one request with :class:`~workbench.engine.sampling.SamplingParams` built from the target's default
sampling, the request's sampling keyword arguments and ``max_tokens``; the priority is the
engine's request priority.  The engine's stream events become :class:`TokenEvent` s with the
engine's own timestamps (``perf_counter`` when the token reached the host):

* a token event -> ``tokens=1`` (the last one also ``finished=True``);
* the engine refused the request (queue full: finish_reason ``"rejected"``) -> ``rejected=True``;
* ``"error"`` / ``"abort"`` -> ``error`` set, with the engine's reason;
* input the engine cannot take (a prompt longer than the context, bad sampling values) -> an
  error event naming the problem, nothing submitted.

When the load generator stops listening (its time is up), the stream is closed and the engine
aborts the request: its KV blocks go back to the pool.

:meth:`metrics` gives the dashboard's series from the engine's last snapshot: ``queue_len``
(waiting), ``running``, ``batch_size`` (sequences computed in the last step), ``kv_usage``,
and the engine's counters (preemptions, rejected, prefix_hit_rate, ...).
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from workbench.errors import ConfigError, WorkbenchError
from workbench.load.target import Prompt, TokenEvent

ERROR_REASONS = ("error", "abort")


class EngineTarget:
    def __init__(self, engine, **sampling) -> None:
        from workbench.engine.sampling import SamplingParams
        from workbench.engine import AsyncEngine, LLMEngine

        if isinstance(engine, LLMEngine):
            engine, owned = AsyncEngine(engine), True
        elif isinstance(engine, AsyncEngine):
            owned = getattr(engine, "_thread", None) is None     # not running yet: we start it, we stop it
        else:
            raise ConfigError(f"EngineTarget: engine must be an AsyncEngine or LLMEngine, got {type(engine).__name__} "
                              "(EngineTarget.from_model(path) builds one from a model folder)")
        try:
            SamplingParams(**sampling)
        except TypeError as e:
            raise ConfigError(f"EngineTarget: {e} (sampling keywords are SamplingParams fields)") from None
        self.aengine, self._owned, self.sampling = engine, owned, dict(sampling)
        self.aengine.start()
        self.sent = 0

    @classmethod
    def from_model(cls, model=None, device=None, dtype=None, scheduler=None, kv=None,
                   max_model_len: int | None = None, **sampling) -> EngineTarget:
        """Load ``model`` (a folder, ``preset:<name>``, or None for the bundled model) into a new
        batched engine; ``scheduler``: a SchedulerConfig, ``kv``: a PagedKVConfig.  The target owns
        the engine: :meth:`close` stops it."""
        from workbench.engine import AsyncEngine, LLMEngine

        eng = LLMEngine(model, device=device, dtype=dtype, kv=kv, scheduler=scheduler, max_model_len=max_model_len)
        return cls(AsyncEngine(eng), **sampling)

    @property
    def engine(self):
        """The :class:`~workbench.engine.core.LLMEngine` (``steps_frame()``, ``stats()``, ``pool``)."""
        return self.aengine.engine

    def params(self, max_tokens: int, **sampling):
        from workbench.engine.sampling import SamplingParams

        try:
            return SamplingParams(**{**self.sampling, **sampling, "max_tokens": max_tokens})
        except TypeError as e:
            raise ConfigError(f"EngineTarget: {e} (sampling keywords are SamplingParams fields)") from None

    async def send(self, prompt: Prompt, max_tokens: int, priority: int = 0, **sampling) -> AsyncIterator[TokenEvent]:
        try:
            params = self.params(max_tokens, **sampling)
        except WorkbenchError as e:
            yield TokenEvent(time.perf_counter(), finished=True, error=f"invalid request: {e}", tokens=0)
            return
        stream = self.aengine.stream(prompt, params, priority=int(priority))
        try:
            try:
                ev = await stream.__anext__()     # submits: the engine's input checks raise here, in this thread
            except WorkbenchError as e:
                yield TokenEvent(time.perf_counter(), finished=True, error=f"invalid request: {e}", tokens=0)
                return
            self.sent += 1
            while True:
                out = self._event(ev)
                yield out
                if out.finished:
                    return
                ev = await stream.__anext__()
        except StopAsyncIteration:
            yield TokenEvent(time.perf_counter(), finished=True, tokens=0,
                             error="engine stream ended without a finished event")
        finally:
            await stream.aclose()     # not finished (cancelled, or the caller stopped reading): the engine
            #                           aborts the request and its blocks go back to the pool

    @staticmethod
    def _event(ev) -> TokenEvent:
        is_token = ev.token_id is not None and ev.token_id >= 0
        reason = ev.finish_reason if ev.finished else None
        if reason == "rejected":
            return TokenEvent(ev.time, finished=True, finish_reason="rejected", rejected=True, tokens=0,
                              error=f"engine rejected the request: {ev.error or 'no reason given'}")
        if reason in ERROR_REASONS:
            return TokenEvent(ev.time, finished=True, finish_reason=reason, tokens=int(is_token),
                              error=f"engine {reason}: {ev.error or 'no reason given'}")
        return TokenEvent(ev.time, text=ev.text or "", token_id=ev.token_id if is_token else None,
                          finished=bool(ev.finished), finish_reason=reason, tokens=int(is_token))

    def metrics(self) -> dict:
        s = self.aengine.stats()
        records = self.engine.step_records
        try:
            last = records[-1] if records else None
        except IndexError:            # emptied by another thread between the check and the read
            last = None
        return {**s, "queue_len": s.get("waiting", 0), "batch_size": last.num_seqs if last is not None else 0}

    # ---- lifecycle ---------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine thread if this target started it (an engine passed in running is left as is)."""
        if self._owned:
            self.aengine.stop()

    def __enter__(self) -> EngineTarget:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EngineTarget({type(self.engine.model).__name__}, sent={self.sent}, owned={self._owned})"
