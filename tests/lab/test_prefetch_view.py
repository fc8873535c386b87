"""The prefetch views, from a real short run of the bundled model with streamed weights (CPU,
disk transport), headless: the Gantt chart's bars are the recorded events, the live view's
widget data changes when it redraws (and only as often as ``refresh_hz`` allows), and the sweep
figures take partial tables."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

import plotly.graph_objects as go  # noqa: E402

from workbench.engine.sampling import SamplingParams  # noqa: E402
from workbench.errors import ConfigError  # noqa: E402
from workbench.lab.prefetch_sweeps import (  # noqa: E402
    block_size_figure,
    distance_sweep_figure,
    resident_fraction_figure,
)
from workbench.lab.prefetch_view import LANES, PrefetchTimelineView, timeline_figure  # noqa: E402
from workbench.prefetch.weights import WeightStreamConfig, stream_weights  # noqa: E402


def _bars(trace) -> int:
    return 0 if trace.x is None else len(trace.x)


def _snapshot(fig) -> dict:
    return {t.name: (list(t.x) if t.x is not None else [], list(t.base) if getattr(t, "base", None) is not None
                     else []) for t in fig.data}


@pytest.fixture(scope="module")
def recorded(bundled_llm):
    """One 4-token greedy run with 4 of 6 layers streamed at distance 2, watched by a live view;
    the model is all-resident again before any test runs."""
    st = stream_weights(bundled_llm.model, WeightStreamConfig(resident_layers=2, distance=2, transport="disk"))
    try:
        view = PrefetchTimelineView(st, window_s=60.0, refresh_hz=20)
        before = _snapshot(view.fig)
        out = view.run(bundled_llm, "The list type is", SamplingParams(temperature=0, max_tokens=4), display=False)
        after = _snapshot(view.fig)
        events, stats = st.prefetcher.timeline(), st.stats()
        static = view.static()
    finally:
        st.remove()
    return dict(view=view, before=before, after=after, events=events, stats=stats, static=static, out=out)


def test_timeline_bars_are_the_recorded_events(recorded):
    events = recorded["events"]
    per_lane = Counter(e["lane"] for e in events)
    assert per_lane["compute"] == 6 * 4 and per_lane["copy"] >= 4 * 4       # every layer, every step
    fig = timeline_figure(events)
    tr = {t.name: t for t in fig.data}
    assert [t.name for t in fig.data] == [*LANES, "step start"]
    for lane in LANES:
        assert _bars(tr[lane]) == per_lane[lane]
        evs = [e for e in events if e["lane"] == lane]
        assert list(tr[lane].base) == pytest.approx([e["start"] * 1e3 for e in evs])
        assert list(tr[lane].x) == pytest.approx([(e["end"] - e["start"]) * 1e3 for e in evs])
        assert set(tr[lane].y) <= {lane}
    assert {str(t) for t in tr["compute"].text} == {f"L{i}" for i in range(6)}
    assert {str(t) for t in tr["copy"].text} == {f"L{i}" for i in range(2, 6)}    # only streamed layers
    copy = tr["copy"].customdata[0]
    assert copy[4].endswith("MiB") and float(copy[5]) > 0                          # bytes and GB/s on hover
    assert "GB/s" in tr["copy"].hovertemplate and "stall" in tr["stall"].hovertemplate
    steps = {e["step"] for e in events}
    assert len([x for x in tr["step start"].x if x is not None]) == 2 * len(steps)   # one line per step
    labels = [a.text for a in fig.layout.annotations]
    assert labels and set(labels) <= {f"step {s}" for s in steps}
    assert f"{len(steps)} steps" in fig.layout.title.text
    json.loads(fig.to_json())                                                    # serialises without a display


def test_timeline_keeps_the_last_steps_and_handles_no_events(recorded):
    events = recorded["events"]
    last = max(e["step"] for e in events)
    fig = timeline_figure(events, max_steps=2)
    kept = [e for e in events if e["step"] >= last - 1]
    assert sum(_bars(t) for t in fig.data[:3]) == len(kept)
    with pytest.raises(ConfigError, match="max_steps"):
        timeline_figure(events, max_steps=0)
    empty = timeline_figure([], title="nothing")
    assert len(empty.data) == 4 and all(_bars(t) == 0 for t in empty.data[:3])
    assert "no prefetch events" in empty.layout.annotations[0].text
    json.loads(empty.to_json())


def test_live_view_redraws_from_the_run(recorded):
    view, before, after = recorded["view"], recorded["before"], recorded["after"]
    assert type(view.fig).__name__ == "FigureWidget"
    assert all(not x for x, _ in before.values())                                  # empty before the run
    per_lane = Counter(e["lane"] for e in recorded["events"])
    for lane in LANES:                                                               # the window holds the run
        assert len(after[lane][0]) == per_lane[lane]
    assert view.redraws >= 1 and len(recorded["out"].token_ids) == 4
    s = recorded["stats"]
    assert f"{s['prefetch_hit_rate']:.0%}" in view.label.value and "GB/s" in view.label.value
    assert "nowrap" in view.label.value and "ellipsis" in view.label.value
    static = recorded["static"]
    assert type(static) is go.Figure and sum(_bars(t) for t in static.data[:3]) == len(recorded["events"])


class FakeSource:
    """A prefetcher stand-in: timeline() and stats() over events the test appends."""

    def __init__(self):
        self.events = []

    def add(self, lane, label, start, end, step, nbytes=0):
        self.events.append(dict(lane=lane, label=label, start=start, end=end, step=step, bytes=nbytes))

    def timeline(self):
        return list(self.events)

    def stats(self):
        return {"prefetch_hit_rate": 0.25, "stall_s": 0.002, "prefetch_efficiency": 0.5, "achieved_gbps": 1.5}


def test_live_view_is_throttled_and_windowed():
    src, now = FakeSource(), [0.0]
    view = PrefetchTimelineView(src, window_s=0.010, refresh_hz=10, clock=lambda: now[0])
    src.add("copy", "L2", 0.000, 0.004, 1, 4 << 20)
    src.add("compute", "L2", 0.004, 0.006, 1)
    assert view.update() and _bars(view.fig.data[0]) == 1 and _bars(view.fig.data[1]) == 1
    src.add("stall", "L3", 0.006, 0.008, 1)
    now[0] = 0.05                                                                    # < 1 / 10 Hz later
    assert not view.update() and _bars(view.fig.data[2]) == 0 and view.redraws == 1
    now[0] = 0.10
    assert view.update() and _bars(view.fig.data[2]) == 1 and view.redraws == 2
    assert list(view.fig.data[2].base) == pytest.approx([6.0])
    src.add("compute", "L0", 0.020, 0.021, 2)                                        # the copy is out of the window
    assert view.update(force=True) and _bars(view.fig.data[0]) == 0 and _bars(view.fig.data[1]) == 1
    assert list(view.fig.layout.xaxis.range) == pytest.approx([11.0, 21.0])
    assert "25%" in view.label.value and "1.50 GB/s" in view.label.value
    assert sum(_bars(t) for t in view.static().data[:3]) == 4                       # static: everything
    for bad in (dict(refresh_hz=0), dict(refresh_hz=50), dict(window_s=0)):
        with pytest.raises(ConfigError):
            PrefetchTimelineView(src, **bad)
    with pytest.raises(ConfigError, match="timeline"):
        PrefetchTimelineView(object())


def test_distance_sweep_figure_takes_partial_rows():
    import pandas as pd

    rows = [{"config": "d=2", "distance": 2, "tokens_per_s": 30.0},
            {"config": "d=0", "distance": 0, "tokens_per_s": 10.0, "tokens_per_s_min": 9.0, "tokens_per_s_max": 12.0,
             "prefetch_hit_rate": 0.0, "prefetch_efficiency": 0.1},
            {"config": "d=1", "distance": 1, "tokens_per_s": 20.0, "prefetch_hit_rate": 0.5}]
    fig = distance_sweep_figure(rows)
    bars = fig.data[0]
    assert list(bars.x) == ["d=0", "d=1", "d=2"] and list(bars.y) == [10.0, 20.0, 30.0]    # sorted by distance
    assert list(bars.error_y.array)[0] == 2.0 and list(bars.error_y.arrayminus)[0] == 1.0
    names = [t.name for t in fig.data]
    assert names == ["tokens / s", "prefetch hit rate", "prefetch efficiency"]
    assert list(fig.data[1].y) == [0.0, 50.0] and list(fig.data[2].x) == ["d=0"]
    same = distance_sweep_figure(pd.DataFrame(rows))                                     # a table works too
    assert list(same.data[0].y) == [10.0, 20.0, 30.0]
    bare = distance_sweep_figure([{"distance": 1, "tokens_per_s": 5.0}])
    assert len(bare.data) == 1 and bare.data[0].error_y.array is None and list(bare.data[0].x) == ["d=1"]
    assert "no rows" in distance_sweep_figure([]).layout.annotations[0].text


def test_resident_fraction_figure():
    rows = [{"resident_fraction": f, "tokens_per_s": 10 + 40 * f, "prefetch_efficiency": f} for f in (1.0, 0.0, 0.5)]
    fig = resident_fraction_figure(rows)
    assert list(fig.data[0].x) == [0.0, 50.0, 100.0] and fig.data[0].error_y.array is None
    assert [t.name for t in fig.data] == ["tokens / s", "prefetch efficiency"]
    by_d = resident_fraction_figure([{**r, "distance": d} for d in (1, 2) for r in rows])
    assert [t.name for t in by_d.data] == ["tokens / s, d=1", "tokens / s, d=2"]
    assert "no rows" in resident_fraction_figure([{"tokens_per_s": 1.0}]).layout.annotations[0].text


@dataclass
class Point:
    transport: str
    block_bytes: int
    gbps_median: float
    gbps_min: float | None = None
    gbps_max: float | None = None


def test_block_size_figure_has_byte_ticks_and_spread():
    pts = [Point("disk", 2 ** e, e / 4, e / 4 - 0.5, e / 4 + 1) for e in range(13, 24)]
    pts += [{"transport": "host", "block_bytes": 2 ** e, "gbps_median": float(e)} for e in (13, 16, 19, 22)]
    fig = block_size_figure(pts)
    assert fig.layout.xaxis.type == "log" and [t.name for t in fig.data] == ["disk", "host"]
    ticks = list(fig.layout.xaxis.ticktext)
    assert ticks[0] == "8 KiB" and "512 KiB" in ticks and all(t.split()[1] in ("KiB", "MiB") for t in ticks)
    assert len(ticks) <= 8                                                           # readable, no overlap
    assert list(fig.data[0].error_y.array) == pytest.approx([1.0] * 11)
    assert list(fig.data[0].error_y.arrayminus) == pytest.approx([0.5] * 11)
    assert fig.data[1].error_y.array is None and fig.data[0].text[0] == "8 KiB"
    assert "no points" in block_size_figure([]).layout.annotations[0].text


def test_lab_exports_the_views():
    import workbench.lab as lab

    assert lab.PrefetchTimelineView is PrefetchTimelineView and lab.block_size_figure is block_size_figure
