"""Traces and what-if replays: run the same arrivals through differently configured engines.

A :class:`Trace` is a list of timed requests (arrival offset, prompt, sampling parameters,
priority).  :func:`replay` feeds it to an :class:`~workbench.engine.core.LLMEngine` in real
time — requests are added when their arrival time comes, the engine steps whenever it has
work, and sleeps until the next arrival otherwise — and returns every request's output and
the per-step records.  Replaying one trace under two scheduler configurations is a what-if
experiment: same load, same prompts, only the policy differs.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field

from workbench.engine.types import RequestOutput
from workbench.errors import ConfigError
from workbench.engine.sampling import SamplingParams
from workbench.engine.core import LLMEngine


@dataclass
class TraceRequest:
    at: float                    # seconds after the trace starts
    prompt: str | list[int]
    params: SamplingParams
    priority: int = 0


@dataclass
class Trace:
    requests: list[TraceRequest] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return max((r.at for r in self.requests), default=0.0)

    @classmethod
    def poisson(cls, prompts: list, rate: float, n: int, params: SamplingParams, seed: int = 0,
                priorities: list[int] | None = None) -> Trace:
        """``n`` requests with exponential gaps (mean 1/rate), prompts cycled, seeded."""
        rng = random.Random(seed)
        t, reqs = 0.0, []
        for i in range(n):
            reqs.append(TraceRequest(t, prompts[i % len(prompts)], params,
                                     priorities[i % len(priorities)] if priorities else 0))
            t += rng.expovariate(rate)
        return cls(reqs)

    @classmethod
    def burst(cls, prompts: list, params: SamplingParams) -> Trace:
        """Everything at once (an offline batch)."""
        return cls([TraceRequest(0.0, p, params) for p in prompts])


@dataclass
class ReplayResult:
    outputs: list[RequestOutput]
    steps: object              # pandas DataFrame of StepRecords
    wall_s: float

    @property
    def tokens_per_s(self) -> float:
        return sum(len(o.token_ids) for o in self.outputs) / self.wall_s


def replay(engine: LLMEngine, trace: Trace, timeout_s: float = 600.0, static_batch: int | None = None) -> ReplayResult:
    """Run ``trace`` through ``engine`` in real time (see the module docstring).

    ``static_batch=B`` replays it under *static batching* instead, the baseline continuous
    batching is measured against: arrived requests are admitted only when the engine is idle,
    at most B at a time, and the batch runs until its last request finishes.  Same engine, same
    model; only the admission policy differs.
    """
    if static_batch is not None and (not isinstance(static_batch, int) or static_batch < 1):
        raise ConfigError(f"replay: static_batch must be an integer >= 1 or None, got {static_batch!r}")
    pending = sorted(trace.requests, key=lambda r: r.at)
    first_step = len(engine.step_records)
    start = engine.clock()
    ids: list[str] = []
    i = 0
    while i < len(pending) or engine.has_unfinished():
        now = engine.clock() - start
        if now > timeout_s:
            raise TimeoutError(f"replay did not finish within {timeout_s} s")
        room = len(pending) if static_batch is None else (0 if engine.has_unfinished() else static_batch)
        while room > 0 and i < len(pending) and pending[i].at <= now:
            room -= 1
            r = pending[i]
            ids.append(engine.add_request(r.prompt, r.params, priority=r.priority, arrival_time=start + r.at))
            i += 1
        if engine.has_unfinished():
            engine.step()
        elif i < len(pending):
            time.sleep(max(0.0, min(pending[i].at - now, 0.05)))
    wall = engine.clock() - start
    steps = engine.steps_frame().iloc[first_step:] if engine.step_records else None
    return ReplayResult([engine.release(r) for r in ids], steps, wall)
