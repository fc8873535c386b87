"""workbench.measure.timing: host clock on a CPU; events or synchronize on a CUDA device.

The CUDA branch is executed on a CPU through recording stand-ins for ``torch.cuda.Event``,
``torch.cuda.current_stream`` and ``torch.cuda.synchronize``.
"""

from __future__ import annotations

import time

import pytest
import torch

from workbench.measure import timing


class FakeEvent:
    log: list = []

    def __init__(self, enable_timing=False):
        assert enable_timing, "timing events must be created with enable_timing=True"
        self.t = None
        self.synced = False

    def record(self, stream=None):
        self.t = time.perf_counter()
        FakeEvent.log.append(("record", stream))

    def synchronize(self):
        self.synced = True
        FakeEvent.log.append(("event_sync", None))

    def query(self):            # the GPU has passed it
        self.synced = True
        return True

    def elapsed_time(self, end):
        assert end.synced, "the end event must be waited for before it is read"
        return 7.0


class _Stream(tuple):
    def wait_stream(self, other):
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    calls = []
    FakeEvent.log = calls
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _Stream(("stream", str(device))))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(("device_sync", str(device))))
    return calls


def test_cpu_uses_the_host_clock_and_never_touches_cuda(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("CUDA touched for a CPU timing")
    monkeypatch.setattr(torch.cuda, "synchronize", boom)
    monkeypatch.setattr(torch.cuda, "Event", boom)
    timing.sync("cpu")
    timing.sync(None)
    with timing.device_timer("cpu") as t:
        time.sleep(0.01)
    assert 8 <= t.ms < 1000 and t.seconds == pytest.approx(t.ms / 1e3)
    ms = timing.time_call(lambda: time.sleep(0.002), torch.device("cpu"), warmup=1, repeats=3)
    assert len(ms) == 3 and all(m >= 1.5 for m in ms)


def test_cuda_events_bracket_the_region_on_the_current_stream(fake_cuda):
    with timing.device_timer("cuda:0") as t:
        fake_cuda.append(("work", None))
    # start recorded before the work, end after; nothing waited for yet (the host is not blocked)
    assert [c[0] for c in fake_cuda] == ["record", "work", "record"]
    assert fake_cuda[0][1] == ("stream", "cuda:0")
    assert t.ms == 7.0
    assert fake_cuda[-1][0] == "event_sync"


def test_cuda_without_events_synchronizes_at_both_ends(fake_cuda):
    with timing.device_timer(torch.device("cuda"), events=False) as t:
        fake_cuda.append(("work", None))
    assert [c[0] for c in fake_cuda] == ["device_sync", "work", "device_sync"]
    assert t.ms >= 0.0


def test_sync_on_cuda_calls_synchronize(fake_cuda):
    timing.sync("cuda")
    timing.sync(torch.zeros(1, device="meta"))      # meta: no-op
    assert fake_cuda == [("device_sync", "cuda")]


def test_time_call_on_cuda_uses_one_event_pair_per_repeat(fake_cuda):
    n = []
    ms = timing.time_call(lambda: n.append(1), "cuda", warmup=2, repeats=3)
    assert ms == [7.0, 7.0, 7.0] and len(n) == 5
    kinds = [c[0] for c in fake_cuda]
    assert kinds.count("record") == 6 and kinds.count("event_sync") == 3
    # the warmup is synchronized away before the first timed call
    assert kinds[0] == "device_sync"


def test_time_call_on_cuda_without_events_syncs_each_call(fake_cuda):
    timing.time_call(lambda: None, "cuda", warmup=0, repeats=2, events=False)
    assert [c[0] for c in fake_cuda] == ["device_sync"] * 5


def test_reading_before_the_end_is_an_error():
    t = timing.DeviceTimer("cuda")
    with pytest.raises(RuntimeError):
        t.ms  # noqa: B018 - reading the property is what must raise
    with pytest.raises(ValueError):
        timing.time_call(lambda: None, "cpu", repeats=0)


def test_elapsed_total_on_cpu_adds_each_region_at_once():
    total = timing.ElapsedTotal()
    for _ in range(2):
        with total.region():
            time.sleep(0.003)
    assert total.pending == 0 and total.seconds >= 0.005
    total.add(1.0)
    assert total.seconds >= 1.005
    total.reset()
    assert total.seconds == 0.0


def test_elapsed_total_on_cuda_sums_event_pairs_when_read(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    total = timing.ElapsedTotal("cuda", resolve_every=3)
    for _ in range(2):
        with total.region():
            pass
    assert total.pending == 2 and [c[0] for c in fake_cuda] == ["record"] * 4    # nothing waited for yet
    with total.region():
        pass
    assert total.pending == 0                    # the third region folded the passed ones in
    with total.region():
        pass
    assert total.seconds == pytest.approx(4 * 7.0 / 1e3)
    assert ("event_sync", None) in fake_cuda and total.pending == 0


def test_elapsed_total_records_nothing_while_a_graph_is_captured(fake_cuda, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    total = timing.ElapsedTotal("cuda")
    with total.region():
        pass
    assert fake_cuda == [] and total.seconds == 0.0


def _fake_graphs(monkeypatch, log, fail=False):
    import contextlib

    class Stream:
        def __init__(self, device=None):
            pass

        def wait_stream(self, other):
            pass

    class Graph:
        def replay(self):
            log.append(("replay", None))

    @contextlib.contextmanager
    def capture(graph):
        log.append(("capture", None))
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("spin", cycles)), raising=False)


def test_time_replays_on_cuda_times_graph_replays_per_call(fake_cuda, monkeypatch):
    _fake_graphs(monkeypatch, fake_cuda)
    n = []
    ms = timing.time_replays(lambda: n.append(1), "cuda", calls=4, repeats=3, warmup=2)
    assert ms == [7.0 / 4] * 3
    kinds = [c[0] for c in fake_cuda]
    assert len(n) == 2 * 4 + 4                         # warm-up rounds, then the captured calls (once)
    assert kinds.count("capture") == 1 and kinds.count("replay") == 1 + 3
    # each sample: spin, start event, replay, end event
    i = kinds.index("spin")
    assert kinds[i:i + 4] == ["spin", "record", "replay", "record"]


def test_time_replays_falls_back_to_eager_calls_when_capture_fails(fake_cuda, monkeypatch):
    _fake_graphs(monkeypatch, fake_cuda, fail=True)
    n = []
    ms = timing.time_replays(lambda: n.append(1), "cuda", calls=2, repeats=2, warmup=1)
    assert ms == [3.5, 3.5] and len(n) == 2 + 2 * 2
    assert [c[0] for c in fake_cuda].count("replay") == 0


def test_time_replays_on_cpu_is_per_call_host_time():
    ms = timing.time_replays(lambda: time.sleep(0.001), "cpu", calls=3, repeats=2)
    assert len(ms) == 2 and all(0.8 <= m < 100 for m in ms)
