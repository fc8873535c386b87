"""Arrival processes and k6-style stages, as pure functions of time (no clock, no sleeping).

A load shape is a piecewise-linear *schedule* ``value(t)``: the request rate (requests/s) for
the open-loop modes, or the number of virtual users for the closed loop.  Stages are given
the k6 way, ``[(duration_s, target), ...]``: each stage ramps linearly from the previous
stage's target (the first from ``start``) to its own target over its duration::

    Schedule.from_stages([(2, 8), (4, 8), (2, 0)])     # ramp up to 8/s, hold 8/s, cool down

Open-loop arrivals come from the cumulative rate ``L(t) = integral of value from 0 to t``:

* ``constant``: the k-th request (k = 0, 1, ...) is sent when ``L(t) = k`` - evenly spaced at
  a constant rate, and a stage receives exactly (to within one) the integral of its rate.
* ``poisson``: unit-rate exponential gaps ``E_i`` (seeded), sent when ``L(t) = E_1 + ... + E_k``.
  This "time rescaling" gives an exact inhomogeneous Poisson process for any ramp.

Example: at 10 req/s the constant offsets are 0.0, 0.1, 0.2, ...; poisson offsets average
0.1 s apart but bunch up and spread out, which is what queues feel.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from collections.abc import Iterator, Sequence

from workbench.errors import ConfigError

_EPS = 1e-9


@dataclass(frozen=True)
class Stage:
    """One k6-style stage: ramp linearly to ``target`` over ``duration_s`` seconds."""
    duration_s: float
    target: float
    name: str | None = None

    @classmethod
    def coerce(cls, s, index: int, field_name: str = "stages") -> Stage:
        if isinstance(s, Stage):
            st = s
        elif isinstance(s, (tuple, list)) and len(s) in (2, 3):
            st = Stage(*s)
        else:
            raise ConfigError(f"{field_name}[{index}]={s!r}: expected (duration_s, target) or "
                              "(duration_s, target, name)")
        if not (isinstance(st.duration_s, (int, float)) and st.duration_s > 0 and math.isfinite(st.duration_s)):
            raise ConfigError(f"{field_name}[{index}].duration_s={st.duration_s!r} must be a finite number > 0")
        if not (isinstance(st.target, (int, float)) and st.target >= 0 and math.isfinite(st.target)):
            raise ConfigError(f"{field_name}[{index}].target={st.target!r} must be a finite number >= 0")
        return st


@dataclass(frozen=True)
class Segment:
    t0: float
    t1: float       # math.inf for an endless constant load
    v0: float
    v1: float
    stage: int      # index of the stage this segment belongs to
    name: str


class Schedule:
    """Piecewise-linear ``value(t)`` for t in [0, end); nothing after ``end``."""

    def __init__(self, segments: Sequence[Segment]) -> None:
        self.segments = list(segments)
        self.end = self.segments[-1].t1 if self.segments else 0.0
        # cumulative integral at each segment start
        self._cum = [0.0]
        for s in self.segments[:-1]:
            self._cum.append(self._cum[-1] + (s.v0 + s.v1) / 2 * (s.t1 - s.t0))

    @classmethod
    def constant(cls, value: float, name: str = "run") -> Schedule:
        return cls([Segment(0.0, math.inf, float(value), float(value), 0, name)])

    @classmethod
    def from_stages(cls, stages: Sequence, start: float = 0.0) -> Schedule:
        segs, t, prev = [], 0.0, float(start)
        for i, raw in enumerate(stages):
            st = Stage.coerce(raw, i)
            name = st.name or _stage_name(i, prev, float(st.target))
            segs.append(Segment(t, t + st.duration_s, prev, float(st.target), i, name))
            t, prev = t + st.duration_s, float(st.target)
        if not segs:
            raise ConfigError("stages is empty: give at least one (duration_s, target)")
        return cls(segs)

    # ---- lookups -----------------------------------------------------------------------------
    def _index(self, t: float) -> int | None:
        for i, s in enumerate(self.segments):
            if s.t0 <= t < s.t1:
                return i
        return None

    def value(self, t: float) -> float:
        i = self._index(t)
        if i is None:
            return 0.0
        s = self.segments[i]
        return s.v0 if s.t1 == math.inf else s.v0 + (s.v1 - s.v0) * (t - s.t0) / (s.t1 - s.t0)

    def stage_at(self, t: float) -> int:
        """Index of the stage at time t (the last one after the end)."""
        i = self._index(t)
        return self.segments[-1 if i is None else i].stage

    def integral(self, t: float) -> float:
        """``L(t)``: the expected number of arrivals in [0, t) at rate ``value``."""
        total = 0.0
        for s, c in zip(self.segments, self._cum):
            if t <= s.t0:
                break
            dt = min(t, s.t1) - s.t0
            slope = 0.0 if s.t1 == math.inf else (s.v1 - s.v0) / (s.t1 - s.t0)
            total = c + s.v0 * dt + 0.5 * slope * dt * dt
        return total

    def inverse_integral(self, y: float) -> float | None:
        """The earliest t with ``L(t) = y``, or None when the schedule ends before that."""
        for s, c in zip(self.segments, self._cum):
            dt_total = s.t1 - s.t0
            area = math.inf if s.t1 == math.inf else (s.v0 + s.v1) / 2 * dt_total
            if y - c <= area + _EPS and area > 0:
                dy = max(0.0, y - c)
                if s.t1 == math.inf:
                    return s.t0 + dy / s.v0
                a = (s.v1 - s.v0) / dt_total
                # v0*x + a*x^2/2 = dy, in the cancellation-free form of the quadratic root
                root = math.sqrt(max(0.0, s.v0 * s.v0 + 2 * a * dy))
                x = 2 * dy / (s.v0 + root) if s.v0 + root > 0 else 0.0
                return s.t0 + min(x, dt_total)
        return None

    def first_time_above(self, level: float, after: float) -> float | None:
        """The earliest t >= ``after`` with ``value(t) > level`` (closed loop: when virtual
        user number ``level`` is active), or None if that never happens again."""
        for s in self.segments:
            if s.t1 <= after:
                continue
            t_start = max(after, s.t0)
            if self.value(t_start) > level + _EPS:
                return t_start
            if s.v1 > s.v0 and s.v1 > level + _EPS:   # a ramp that crosses the level
                t = s.t0 + (level - s.v0) / (s.v1 - s.v0) * (s.t1 - s.t0)
                return max(t_start, t) + 1e-6
        return None

    def stage_windows(self) -> list[tuple[int, str, float, float, float]]:
        """(stage index, name, t0, t1, target) per stage."""
        return [(s.stage, s.name, s.t0, s.t1, s.v1) for s in self.segments]


def _stage_name(i: int, a: float, b: float) -> str:
    kind = "ramp-up" if b > a else ("cool-down" if b < a else "hold")
    return f"{i}: {kind} {a:g}->{b:g}" if a != b else f"{i}: hold {b:g}"


def arrival_offsets(schedule: Schedule, mode: str, seed: int = 0) -> Iterator[float]:
    """Send times (seconds from the start of the run) for an open-loop ``mode``:
    ``"constant"`` or ``"poisson"``; ends when the schedule does (endless for a constant
    schedule: the caller bounds it by count or time)."""
    if mode not in ("constant", "poisson"):
        raise ConfigError(f"mode={mode!r}: open-loop arrivals are 'constant' or 'poisson'")
    rng = random.Random(seed)
    total = schedule.integral(schedule.end) if math.isfinite(schedule.end) else math.inf
    y = 0.0 if mode == "constant" else rng.expovariate(1.0)
    while y < total - _EPS:     # the arrival due exactly at the end belongs to the next run
        t = schedule.inverse_integral(y)
        if t is None or t >= schedule.end:
            return
        yield t
        y += 1.0 if mode == "constant" else rng.expovariate(1.0)
