"""Replays: recorded frames become one plotly figure with frames, play / pause / speed buttons and a
scrubber labelled in ms (workbench.lab.replay)."""

from __future__ import annotations

import pytest

go = pytest.importorskip("plotly.graph_objects")

from workbench.lab.replay import (MAX_FRAME_MS, MIN_FRAME_MS, SPEEDS, Frame, Recorder, has_replay,  # noqa: E402
                                  replay_figure, thin)


def frames(n: int, gap_ms: float = 10.0) -> list[Frame]:
    return [Frame(i * gap_ms, [{"y": [i, i + 1]}], f"step {i}") for i in range(n)]


def test_thin_keeps_first_last_and_order():
    fs = frames(1000)
    kept = thin(fs, 50)
    assert len(kept) == 50 and kept[0] is fs[0] and kept[-1] is fs[-1]
    assert [f.t_ms for f in kept] == sorted(f.t_ms for f in kept)
    assert thin(fs[:10], 50) == fs[:10]


def test_recorder_drops_unchanged_frames_and_measures_itself():
    ticks = iter([0.0, 0.001, 0.002, 0.005])
    rec = Recorder(clock=lambda: next(ticks))
    assert rec.add([{"z": [1]}], "a") and not rec.add([{"z": [1]}], "a again")
    assert rec.add([{"z": [2]}], "b")
    assert [f.t_ms for f in rec.frames] == [0.0, 2.0] and rec.dropped == 1
    assert rec.seconds > 0 and "2 frames" in rec.cost_text() and "1 unchanged" in rec.cost_text()
    with pytest.raises(ValueError):
        Recorder(max_frames=1)


def test_replay_figure_has_frames_controls_and_ms_labels():
    fig = go.Figure(go.Scatter(x=[0, 1], y=[0, 0]))
    replay_figure(fig, frames(300, gap_ms=2.5), max_frames=60, redraw=False, note="cost line")
    js = fig.to_plotly_json()
    assert has_replay(js) and len(fig.frames) == 60
    assert list(fig.data[0].y) == [0, 1]                                  # drawn as the first frame shows it
    steps = fig.layout.sliders[0].steps
    assert len(steps) == 60 and steps[0].label == "0.0 ms · step 0" and steps[-1].label.startswith("747.5 ms")
    labels = [b.label for m in fig.layout.updatemenus for b in m.buttons]
    assert "▶ play" in labels and "❚❚ pause" in labels and all(f"{s:g}x" in labels for s in SPEEDS)
    # the recorded pace (gaps of 2.5 ms x thinning) is clamped to what plotly can draw
    durations = [b.args[1]["frame"]["duration"] for m in fig.layout.updatemenus for b in m.buttons
                 if b.args[0] is None]
    assert all(MIN_FRAME_MS <= d <= MAX_FRAME_MS for d in durations)
    assert any("cost line" in a.text for a in fig.layout.annotations)


def test_no_frames_leaves_the_figure_alone():
    fig = go.Figure(go.Scatter(x=[0], y=[0]))
    assert replay_figure(fig, []) is fig and not fig.frames and not has_replay(fig.to_plotly_json())
