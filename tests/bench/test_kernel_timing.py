"""kernel_timing.time_calls on CUDA, run on a CPU through stand-ins for torch.cuda: after the L2
flush a spin kernel keeps the GPU busy while the host enqueues the call, so the start event does
not fire before the call's kernels are queued (µs kernels were charged the host's launch time)."""

from __future__ import annotations

import pytest
import torch

import workbench.bench.kernel_timing as kt


def test_flushed_calls_spin_between_the_flush_and_the_start_event(monkeypatch):
    order = []

    class Ev:
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            order.append("record")

        def elapsed_time(self, end):
            return 0.5

    class Flush:
        def zero_(self):
            order.append("flush")

    monkeypatch.setattr(torch.cuda, "Event", Ev)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda dev=None: order.append("sync"))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: order.append(("spin", cycles)), raising=False)
    dev = torch.device("cuda", 0)
    monkeypatch.setitem(kt._FLUSH, dev, Flush())
    out = kt.time_calls(lambda: order.append("fn"), dev, warmup=1, repeats=2, flush_l2=True)
    assert out == [pytest.approx(5e-4)] * 2
    assert order == ["fn", "sync"] + ["flush", ("spin", kt.SPIN_CYCLES), "record", "fn", "record", "sync"] * 2
    order.clear()
    kt.time_calls(lambda: order.append("fn"), dev, warmup=0, repeats=1)       # no flush: no spin either
    assert order == ["sync", "record", "fn", "record", "sync"]


def test_cpu_calls_use_the_host_clock():
    out = kt.time_calls(lambda: sum(range(1000)), torch.device("cpu"), warmup=1, repeats=3)
    assert len(out) == 3 and all(0 < t < 1 for t in out)


def test_compare_timing_states_the_noise():
    def row(ms: float) -> dict:
        return {"ms_median": ms, "ms_min": ms * 0.9, "ms_max": ms * 1.1}

    ref = row(10.0)
    assert kt.compare_timing(row(10.5), ref).startswith("within noise")
    assert kt.compare_timing(row(30.0), ref) == "3x slower"
    assert kt.compare_timing(row(5.0), ref) == "2x faster"
