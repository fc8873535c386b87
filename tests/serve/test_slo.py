"""The SLO guard: a latency circuit breaker, driven by a scripted TTFT trace on a fake clock
(deterministic: no sleeping), then as a target wrapper in short runs against the fake model -
on a virtual clock (``virtual_time``) wherever the outcome depends on timing, so the guard
sees the same TTFTs on any machine, loaded or not."""

from __future__ import annotations

import math
import re
import sys
from pathlib import Path

import pytest

from workbench.errors import ConfigError
from workbench.load import FakeTarget, LoadConfig, LoadRun, run_load_sync
from workbench.serve.slo import GuardedTarget, SLOConfig, SLOGuard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # virtual_time, also under --import-mode=importlib
from virtual_time import VirtualTime  # noqa: E402


class FakeClock:
    def __init__(self, t: float = 0.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def make(**kw) -> tuple[SLOGuard, FakeClock]:
    clock = FakeClock()
    cfg = SLOConfig(**{"window": 20, "min_samples": 10, "factor": 2.0, "ewma_alpha": 0.1, "cooldown_s": 5.0,
                       "probes": 3, "bypass_priorities": (1,), **kw})
    return SLOGuard(cfg, clock=clock), clock


def feed(guard: SLOGuard, clock: FakeClock, ttft_s: float, n: int, dt: float = 0.1) -> list[str]:
    states = []
    for _ in range(n):
        clock.t += dt
        guard.admit()
        states.append(guard.record(ttft_s))
    return states


def test_opens_on_latency_degradation_without_any_failure_then_recovers():
    g, clock = make()
    # 1. healthy: 100 ms. The baseline is seeded from the first 10 samples, then tracks
    assert feed(g, clock, 0.100, 30) == ["closed"] * 30
    assert g.baseline == pytest.approx(0.100) and g.threshold == pytest.approx(0.200)
    # 2. latency triples, nothing fails: one slow sample is not enough (P95 of 20 = 110 ms) ...
    assert feed(g, clock, 0.300, 1) == ["closed"]
    assert g.p95() == pytest.approx(0.110)
    # ... the second lifts the window's P95 to 300 ms > 2 x baseline: open
    assert feed(g, clock, 0.300, 1) == ["open"]
    opened = clock.t
    assert g.transitions[-1][1:3] == ("closed", "open")
    assert "TTFT P95 300.0 ms > 2 x baseline 101.0 ms" in g.open_reason
    # 3. open: shed with a reason; priority 1 passes; late results do not count
    d = g.admit()
    assert not d.admit and d.state == "open" and d.reason.startswith("SLO guard open: TTFT P95 300.0 ms")
    assert d.reason == "SLO guard open: " + g.open_reason and d.retry_after is None   # policy="reject"
    assert g.admit(priority=1).admit and g.admit(priority=1).reason.startswith("priority 1 bypasses")
    assert g.record(0.5) == "open" and g.snapshot()["window_samples"] == 0
    clock.t = opened + 4.99
    assert g.state == "open" and not g.admit().admit
    # 4. cool-down over: half-open admits exactly `probes` requests
    clock.t = opened + 5.0
    assert g.state == "half_open"
    probes = [g.admit() for _ in range(4)]
    assert [p.admit for p in probes] == [True, True, True, False] and all(p.probe for p in probes[:3])
    assert "half-open" in probes[3].reason
    # 5. healthy probes close it; the window restarts from them
    assert [g.record(0.1, probe=True) for _ in range(3)] == ["half_open", "half_open", "closed"]
    assert g.snapshot()["window_samples"] == 3 and g.admit().admit
    assert [t[2] for t in g.transitions] == ["open", "half_open", "closed"]


def test_unhealthy_probes_reopen_and_failed_probes_count_as_unhealthy():
    g, clock = make(baseline_s=0.1)
    feed(g, clock, 0.1, 10)
    feed(g, clock, 0.5, 2)
    assert g.state == "open"
    clock.t += 5
    assert [g.admit().probe for _ in range(3)] == [True, True, True]
    g.record(0.1, probe=True)
    g.record(math.inf, probe=True)            # a probe that errored before its first token
    assert g.record(0.1, probe=True) == "open"
    assert g.open_reason == "1 of 3 probes failed before their first token"
    assert [t[2] for t in g.transitions] == ["open", "half_open", "open"]
    assert g.snapshot()["trips"] == 2


def test_stale_results_and_probe_timeouts_in_half_open():
    g, clock = make(baseline_s=0.1, probe_timeout_s=1.0)
    feed(g, clock, 0.1, 10)
    feed(g, clock, 0.5, 2)
    clock.t += 5
    assert all(g.admit().admit for _ in range(3)) and not g.admit().admit
    assert g.record(0.9, probe=False) == "half_open"    # admitted before it opened: not evidence
    assert g.snapshot()["probe_results"] == 0
    clock.t += 1.5                                      # the probes never reported: their slots free up
    assert [g.admit().probe for _ in range(3)] == [True, True, True]


def test_a_late_probe_of_an_earlier_half_open_cycle_does_not_decide_the_current_one():
    g = SLOGuard(SLOConfig(baseline_s=0.1, factor=2.0, learn_factor=1.25, window=1, min_samples=1,
                           cooldown_s=1.0, probes=1))
    assert g.record(1.0, now=0.0) == "open"
    p1 = g.admit(now=1.1)                                 # cycle 1: probe P1 ...
    assert p1.admit and p1.probe
    p2 = g.admit(now=2.2)                                 # ... times out: probe P2
    assert p2.admit and p2.probe
    assert g.record(math.inf, now=2.3, probe=True, admitted_at=2.2) == "open"   # P2 failed: reopens at 2.3
    assert g.state_at(3.4) == "half_open"                 # cycle 2, no probe admitted in it yet
    n_transitions = len(g.transitions)
    # P1 reports late: admitted before the last opening, it is stale and decides nothing
    assert g.record(2.3, now=3.4, probe=True, admitted_at=1.1) == "half_open"
    assert g.counts["stale"] == 1 and len(g.transitions) == n_transitions
    assert g.snapshot(now=3.4)["probe_results"] == 0
    # ... and freed nothing of cycle 2: its one probe slot is taken by P3, then full
    p3 = g.admit(now=3.5)
    assert p3.admit and p3.probe
    assert g.record(0.9, now=3.55, probe=True, admitted_at=1.1) == "half_open"   # another stale one
    assert g.snapshot(now=3.55)["probes_pending"] == 1
    assert not g.admit(now=3.6).admit
    assert g.record(0.05, now=3.7, probe=True, admitted_at=3.5) == "closed"      # P3 decides cycle 2


def test_a_probe_admitted_at_the_instant_the_guard_reopened_is_stale():
    g = SLOGuard(SLOConfig(baseline_s=0.1, window=1, min_samples=1, cooldown_s=1.0, probes=2))
    g.record(1.0, now=0.0)
    assert g.admit(now=1.5).probe and g.admit(now=1.5).probe
    g.record(1.0, now=1.5, probe=True, admitted_at=1.5)
    assert g.record(1.0, now=1.5, probe=True, admitted_at=1.5) == "open"          # reopened at 1.5
    assert g.state_at(2.6) == "half_open"
    assert g.record(1.0, now=2.6, probe=True, admitted_at=1.5) == "half_open"     # of the decided cycle
    assert g.counts["stale"] == 1


def test_baseline_learns_only_from_healthy_periods():
    g, clock = make(learn_factor=1.25)
    feed(g, clock, 0.1, 20)
    feed(g, clock, 0.15, 20)                 # 1.5 x: slower, not yet an outage
    b = g.baseline
    assert b < 0.105                         # learned only while the window's P95 was still <= 1.25 x
    feed(g, clock, 0.15, 20)                 # a whole window at 1.5 x: no learning at all
    assert g.state == "closed" and g.baseline == b
    feed(g, clock, 0.11, 20)                 # within 1.25 x: the baseline follows slowly
    assert b < g.baseline < 0.11


def test_min_threshold_ignores_noise_at_tiny_latencies():
    g, clock = make(baseline_s=0.001, min_threshold_s=0.05)
    feed(g, clock, 0.001, 10)
    assert feed(g, clock, 0.01, 5)[-1] == "closed"      # 10x the baseline but under 50 ms
    assert feed(g, clock, 0.08, 2)[-1] == "open"


def test_queue_policy_asks_to_retry_after_the_cooldown():
    g, clock = make(baseline_s=0.1, policy="queue")
    feed(g, clock, 0.1, 10)
    feed(g, clock, 0.4, 2)
    clock.t = g.opened_at + 2.0
    before = g.counts["deferred"]
    d = g.admit()
    assert not d.admit and d.retry_after == pytest.approx(3.0) and g.counts["deferred"] == before + 1
    assert g.counts["rejected"] == 0            # deferred, not refused


def test_snapshot_has_what_views_need():
    g, clock = make()
    feed(g, clock, 0.1, 12)
    s = g.snapshot()
    assert {"state", "baseline_s", "threshold_s", "p95_s", "window_samples", "trips", "admitted", "rejected",
            "deferred", "bypassed", "probes"} <= set(s)
    assert s["state"] == "closed" and s["admitted"] == 12 and s["samples"] == 12


@pytest.mark.parametrize("kw, field", [
    ({"factor": 1.0}, "factor"), ({"quantile": 1.0}, "quantile"), ({"window": 0}, "window"),
    ({"window": 5, "min_samples": 6}, "min_samples"), ({"ewma_alpha": 0}, "ewma_alpha"),
    ({"learn_factor": 3.0}, "learn_factor"), ({"baseline_s": 0}, "baseline_s"), ({"cooldown_s": 0}, "cooldown_s"),
    ({"probes": 0}, "probes"), ({"policy": "drop"}, "policy"), ({"min_threshold_s": -1}, "min_threshold_s"),
    ({"probe_timeout_s": 0}, "probe_timeout_s"), ({"queue_timeout_s": -1}, "queue_timeout_s"),
    ({"bypass_priorities": ("high",)}, "bypass_priorities"),
])
def test_config_errors_name_the_field(kw, field):
    with pytest.raises(ConfigError, match=re.escape(f"SLOConfig.{field}=")):
        SLOConfig(**kw)


# ---- as a target wrapper ---------------------------------------------------------------------------------
def _tripped_guard(clock=None, **kw) -> SLOGuard:
    g = SLOGuard(SLOConfig(baseline_s=0.01, window=4, min_samples=2, **kw), **({"clock": clock} if clock else {}))
    g.record(0.1)
    g.record(0.1)
    assert g.state == "open"
    return g


def test_guarded_target_rejects_without_sending():
    inner = FakeTarget(ttft_s=0.005, token_delay_s=0.002)
    guard = _tripped_guard(cooldown_s=60, bypass_priorities=(1,))
    cfg = LoadConfig(mode="constant", rate=200, max_requests=4, max_tokens=2, prompts=["p"],
                     priority=lambda i: int(i == 3))
    res = run_load_sync(GuardedTarget(inner, guard), cfg)
    assert [r.status for r in res.records] == ["rejected"] * 3 + ["ok"]
    assert all(r.reason.startswith("SLO guard open: TTFT P95 100.0 ms > 2 x baseline 10.0 ms")
               for r in res.records[:3])
    assert inner.priorities == [1]                    # only the bypassing request reached the model
    assert guard.counts["rejected"] == 3 and guard.counts["bypassed"] == 1


def test_guarded_target_queue_policy_waits_for_the_probe_slot():
    with VirtualTime() as vt:
        inner = FakeTarget(ttft_s=0.005, token_delay_s=0.002, clock=vt.clock)
        opened = vt.clock()
        guard = _tripped_guard(cooldown_s=0.15, policy="queue", probes=1, queue_timeout_s=0.5, clock=vt.clock)
        evs = vt.run(_send(GuardedTarget(inner, guard, clock=vt.clock)))
        assert evs[-1].finished and evs[-1].error is None and guard.state == "closed"   # the probe was healthy
        # held until the cool-down ended, then admitted as the probe: its first token 5 ms later
        assert evs[0].time == pytest.approx(opened + 0.15 + 0.005)
        assert guard.counts["deferred"] >= 1 and guard.counts["probes"] == 1
        guard2 = _tripped_guard(cooldown_s=5, policy="queue", queue_timeout_s=0.05, clock=vt.clock)
        t0 = vt.clock()
        evs = vt.run(_send(GuardedTarget(inner, guard2, clock=vt.clock)))
        assert evs[-1].rejected and "timed out" in evs[-1].error and guard2.counts["rejected"] == 1
        assert evs[-1].time - t0 == pytest.approx(0.05)            # gave up at the queue timeout


async def _send(target):
    return [ev async for ev in target.send("p", 2)]


def run_virtual(cfg: LoadConfig, guard_config: SLOConfig | None = None, **fake):
    """``cfg`` against ``FakeTarget(**fake)`` - behind an SLOGuard(guard_config) when given - on a
    virtual clock: (result, guard or None, the fake model)."""
    with VirtualTime() as vt:
        inner = FakeTarget(clock=vt.clock, **fake)
        guard = None if guard_config is None else SLOGuard(guard_config, clock=vt.clock)
        target = inner if guard is None else GuardedTarget(inner, guard, clock=vt.clock)
        res = vt.run(LoadRun(target, cfg, clock=vt.clock).arun())
    return res, guard, inner


def test_guard_sheds_a_degrading_target_under_a_ramp():
    """Demo in miniature: a fake model that slows as its batch fills; the guard learns the
    healthy TTFT, opens when the ramp pushes P95 past 2x, and sheds with reasons."""
    cfg = LoadConfig(mode="constant", stages=[(0.3, 20), (0.4, 200)], max_tokens=4, prompts=["p"])
    res, guard, inner = run_virtual(cfg, SLOConfig(window=10, min_samples=5, factor=2.0, cooldown_s=0.1, probes=2),
                                    ttft_s=0.01, token_delay_s=0.002, capacity=2, slowdown=0.5)
    status = [r.status for r in res.records]
    assert status.count("error") == 0 and status.count("ok") > 0
    assert status.count("rejected") > 0 and guard.snapshot()["trips"] >= 1
    assert all(r.reason.startswith("SLO guard") for r in res.records if r.status == "rejected")
    assert len(inner.priorities) == len(res.records) - status.count("rejected")


def test_stale_samples_after_recovery_do_not_retrip():
    """A request admitted before the guard opened reports its (slow) TTFT after the probes have
    closed it again: stale evidence, ignored."""
    g, clock = make(baseline_s=0.1, probes=1)
    feed(g, clock, 0.1, 10)
    admitted_early = clock.t
    feed(g, clock, 0.5, 2)
    assert g.state == "open"
    clock.t += 5
    assert g.admit().probe and g.record(0.1, probe=True) == "closed"
    for _ in range(12):
        assert g.record(0.9, probe=False, admitted_at=admitted_early) == "closed"
    assert g.counts["stale"] == 12 and g.snapshot()["window_samples"] == 1
    assert feed(g, clock, 0.9, 10)[-1] == "open"         # fresh slow samples still open it


def _p95(res) -> float:
    import numpy as np

    return float(np.percentile([r.ttft for r in res.records if r.status == "ok"], 95))


def test_guard_opens_sheds_and_recovers_under_a_scripted_overload_ramp():
    """The same scripted run twice - a warm-up, a ramp into overload (the fake model's capacity
    is ~50 req/s and it slows as its batch fills; nothing ever fails), a hold, then a quiet
    stage - once bare and once behind the guard.  The guard learns its baseline online, opens,
    sheds with reasons, probes after each cool-down and ends closed; the admitted requests'
    P95 TTFT stays far below the unguarded run's."""
    cfg = LoadConfig(mode="constant", stages=[(0.8, 10, "warm"), (0.5, 120, "ramp"), (0.6, 120, "peak"),
                                              (0.05, 5, "drop"), (1.0, 5, "quiet")],
                     max_tokens=8, prompts=["p"], max_duration_s=30)

    fake = dict(ttft_s=0.01, token_delay_s=0.003, capacity=2, slowdown=0.3)
    bare, _, _ = run_virtual(cfg, **fake)
    guarded, guard, _ = run_virtual(cfg, SLOConfig(window=10, min_samples=5, factor=2.0, cooldown_s=0.2, probes=3),
                                    **fake)

    assert len(bare.records) == len(guarded.records)                 # the same arrivals
    assert all(r.status == "ok" for r in bare.records)               # overload without a single failure
    st = [r.status for r in guarded.records]
    assert st.count("error") == 0 and st.count("rejected") > 0
    assert all(r.reason.startswith("SLO guard") for r in guarded.records if r.status == "rejected")
    moves = [(a, b) for _, a, b, _ in guard.transitions]
    assert ("closed", "open") in moves and ("open", "half_open") in moves and ("half_open", "closed") in moves
    assert guard.state == "closed" and guard.baseline is not None    # recovered by the end
    warm = [r for r in guarded.records if r.stage_name == "warm"]
    assert warm and all(r.status == "ok" for r in warm)              # healthy load is never shed
    quiet_late = [r for r in guarded.records if r.stage_name == "quiet" and r.sent > guarded.stages[-1][2] + 0.5]
    assert quiet_late and all(r.status == "ok" for r in quiet_late)
    assert _p95(guarded) < 0.5 * _p95(bare)
