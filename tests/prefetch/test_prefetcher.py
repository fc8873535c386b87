"""The prefetcher's accounting: hits, demand fetches, stalls, bytes and GB/s, efficiency, link
use against a given ceiling, and the timeline's lanes - driven by a transport whose copies take
a known time."""

from __future__ import annotations

import time

import pytest
import torch

from workbench.prefetch.prefetcher import Prefetcher
from workbench.prefetch.transports import HostTransport

COPY_S = 0.03


class SlowHost(HostTransport):
    """Every copy takes at least COPY_S."""

    def _copy(self, key, out):
        time.sleep(COPY_S)
        super()._copy(key, out)


@pytest.fixture
def pf():
    p = Prefetcher(SlowHost(), ceiling_gbps=1.0, name="test")
    for k in range(3):
        p.put(k, torch.full((1024,), float(k)))
    yield p
    p.close()


def _buf():
    return torch.empty(1024)


def test_a_prediction_that_finished_is_a_hit_without_stall(pf):
    buf = _buf()
    pf.submit(0, buf)
    time.sleep(COPY_S * 3)
    job = pf.wait(0, label="L0")
    st = pf.stats()
    assert (st["uses"], st["hits"], st["demand"], st["predicted"]) == (1, 1, 0, 1)
    assert st["prefetch_hit_rate"] == 1.0 and st["stall_s"] < COPY_S / 2 and torch.all(buf == 0)
    assert st["bytes"] == 4096 and st["copy_s"] >= COPY_S * 0.9 and job.seconds >= COPY_S * 0.9
    assert st["achieved_gbps"] == pytest.approx(4096 / st["copy_s"] / 1e9)
    assert st["link_use"] == pytest.approx(st["achieved_gbps"] / 1.0)
    assert st["prefetch_efficiency"] > 0.5


def test_a_late_prediction_stalls_and_is_no_hit(pf):
    pf.submit(1, _buf())
    pf.wait(1)
    st = pf.stats()
    assert st["hits"] == 0 and st["demand"] == 0 and st["stall_s"] >= COPY_S * 0.5
    assert [e["lane"] for e in pf.timeline()].count("stall") == 1


def test_an_unpredicted_use_is_a_demand_fetch(pf):
    buf = _buf()
    pf.wait(2, buf)
    pf.fetch_now(1, buf)
    st = pf.stats()
    assert (st["fetches"], st["demand"], st["predicted"], st["hits"], st["uses"]) == (2, 2, 0, 0, 2)
    assert torch.all(buf == 1) and st["prefetch_efficiency"] < 0.2
    with pytest.raises(KeyError, match="no buffer was given"):
        pf.wait(0)


def test_a_second_submit_of_a_pending_key_is_one_fetch(pf):
    buf = _buf()
    assert pf.submit(0, buf) is pf.submit(0, buf)
    pf.wait(0)
    assert pf.stats()["fetches"] == 1


def test_timeline_has_copy_compute_and_stall_lanes_in_time_order(pf):
    buf = _buf()
    pf.step = 1
    pf.submit(0, buf)
    t0 = time.perf_counter()
    time.sleep(0.005)
    pf.compute("L9", t0, time.perf_counter())
    pf.wait(0, label="L0")
    tl = pf.timeline()
    lanes = {e["lane"] for e in tl}
    assert lanes == {"copy", "compute", "stall"} and tl[0]["start"] == 0.0
    assert all(a["start"] <= b["start"] for a, b in zip(tl, tl[1:]))
    copy = next(e for e in tl if e["lane"] == "copy")
    assert copy["label"] == "L0" and copy["bytes"] == 4096 and copy["step"] == 1 and copy["end"] > copy["start"]
    pf.reset_stats()
    assert pf.timeline() == [] and pf.stats()["uses"] == 0 and pf.stats()["ceiling_gbps"] == 1.0


def test_drain_waits_for_pending_copies(pf):
    buf = _buf()
    job = pf.submit(2, buf)
    pf.drain()
    assert job.done() and not pf.pending and torch.all(buf == 2)


# ---- the CUDA branches, on a CPU (tests/fake_cuda.py) ---------------------------------------------
def test_reset_stats_on_cuda_waits_for_the_device_and_carries_nothing_over(monkeypatch):
    """Prefill copies still in flight at the reset must not land in the decode counters."""
    from fake_cuda import FakeCudaTransport, install

    calls = install(monkeypatch)
    pf = Prefetcher(FakeCudaTransport())

    class Late:
        def query(self):
            return False

    pf._unresolved.append((None, Late(), Late(), "prefill", 0, False))
    pf.reset_stats()
    assert pf._unresolved == [], "pre-reset events would resolve into the new counters"
    assert ("synchronize", "cuda") in calls


def test_unread_cuda_events_stay_bounded(monkeypatch):
    """A server that never reads stats(): the pending timing events are folded in as they go."""
    import workbench.prefetch.prefetcher as pmod
    from fake_cuda import FakeCudaTransport, FakeEvent, install

    install(monkeypatch)
    pf = Prefetcher(FakeCudaTransport(timing=True))
    for i in range(10_000):
        a, b = FakeEvent(True), FakeEvent(True)
        a.record()
        b.record()
        pf.compute(f"L{i % 16}", a, b)
    assert len(pf._unresolved) < pmod.RESOLVE_EVERY
    pf.put("w", torch.arange(64, dtype=torch.uint8))
    for _ in range(50):
        pf.wait("w", torch.empty(64, dtype=torch.uint8))
    assert len(pf._unresolved) < pmod.RESOLVE_EVERY
    st = pf.stats()
    assert st["uses"] == 50 and st["demand"] == 50
