"""Notebook 03's timeline replay (workbench.lab.prefetch_view.timeline_replay and the live view's
recording), checked as data: one frame per recorded step, each showing only what had happened by
then (the x range ends at the last event of its steps, a curtain over the rest), the run's
controls, and the recording's cost stated; then on a real streamed run of the bundled model."""

from __future__ import annotations

import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from workbench.engine.sampling import SamplingParams  # noqa: E402
from workbench.lab.prefetch_view import PrefetchTimelineView, timeline_replay  # noqa: E402
from workbench.lab.replay import has_replay  # noqa: E402
from workbench.prefetch.weights import WeightStreamConfig, stream_weights  # noqa: E402


def _events(steps: int = 5) -> list[dict]:
    """Two layers a step, 10 ms each (s in seconds), a copy of the next layer under each compute,
    a stall in step 2."""
    out = []
    for s in range(steps):
        t = s * 0.02
        out += [{"lane": "compute", "label": f"L{i}", "start": t + 0.01 * i, "end": t + 0.01 * (i + 1), "step": s,
                 "bytes": 0} for i in range(2)]
        out.append({"lane": "copy", "label": "L1", "start": t, "end": t + 0.008, "step": s, "bytes": 4096})
    out.append({"lane": "stall", "label": "L1", "start": 0.05, "end": 0.052, "step": 2, "bytes": 0})
    return out


def test_one_frame_per_step_each_showing_only_the_past():
    fig = timeline_replay(_events(), window_ms=30.0, title="T")
    assert has_replay(fig.to_plotly_json()) and len(fig.frames) == 5
    ranges = [list(f.layout.xaxis.range) for f in fig.frames]
    ends = [r[1] for r in ranges]
    assert ranges[0] == pytest.approx([0.0, 30.0])                     # the window fills from the run's start
    assert ranges[-1] == pytest.approx([70.0, 100.0])                  # then scrolls: ends at step 4's last event
    assert ends == sorted(ends) and ranges[1] != ranges[-1]             # scrubbing moves the view
    curtains = [f.layout.shapes[0] for f in fig.frames]
    assert curtains[0].x0 == pytest.approx(20.0) and curtains[0].x1 == pytest.approx(30.0)   # after step 0: covered
    assert all(f.data == () for f in fig.frames)                       # layout only: small frames
    titles = [f.layout.title.text for f in fig.frames]
    assert "up to step 0" in titles[0] and "stall 0.0 ms" in titles[0] and "stall 2.0 ms" in titles[-1]
    assert [s.label.split(" · ")[1] for s in fig.layout.sliders[0].steps] == [f"step {s}" for s in range(5)]
    assert len(fig.data[0].x) == 5 and len(fig.data[1].x) == 10        # every bar drawn once, in the figure


def test_marks_choose_the_frames_and_their_times():
    fig = timeline_replay(_events(), marks=[(0.0, 1), (5.0, 3), (9.0, 9)], window_ms=30.0)
    assert [s.label for s in fig.layout.sliders[0].steps] == ["0.0 ms · step 1", "5.0 ms · step 3", "9.0 ms · step 9"]
    assert list(fig.frames[0].layout.xaxis.range) == pytest.approx([10.0, 40.0])    # ends where step 1 ends
    assert not timeline_replay([]).frames                               # no events: the empty chart, no replay


@pytest.fixture(scope="module")
def streamed(bundled_llm):
    st = stream_weights(bundled_llm.model, WeightStreamConfig(resident_layers=2, distance=2, transport="disk"))
    try:
        view = PrefetchTimelineView(st, window_s=0.05, refresh_hz=20)
        out = view.run(bundled_llm, "The list type is", SamplingParams(temperature=0, max_tokens=5), display=False)
        events = st.prefetcher.timeline()
        fig = view.replay(title="live")
    finally:
        st.remove()
    return dict(view=view, out=out, events=events, fig=fig)


def test_the_live_view_records_a_step_per_token(streamed):
    view, fig, events = streamed["view"], streamed["fig"], streamed["events"]
    steps = [f.data[0]["step"] for f in view.recorder.frames]
    assert steps == sorted(set(steps)) and len(steps) == len(streamed["out"].token_ids)
    assert view.record_events == len(streamed["out"].token_ids) + 1 and "µs per token" in view.record_cost()
    assert len(fig.frames) == len(steps) and has_replay(fig.to_plotly_json())
    ends = [f.layout.xaxis.range[1] for f in fig.frames]
    assert ends == sorted(ends) and ends[0] < ends[-1]
    assert ends[-1] == pytest.approx(max(e["end"] for e in events if e["step"] <= steps[-1]) * 1e3)
    assert "µs per token" in " ".join(a.text for a in fig.layout.annotations)
    off = PrefetchTimelineView(view.source, record=False)
    assert off.recorder is None and off.record_cost() == "nothing recorded"


class _Bar:
    """What a notebook's Progress bar is told: its total, each run's name, each run's end."""

    def __init__(self):
        self.total, self.started, self.done = None, [], 0

    def start(self, name):
        self.started.append(name)

    def advance(self, n=1):
        self.done += n


def test_the_link_experiment_tells_a_progress_bar_what_runs():
    from workbench.bench.prefetch import block_size_experiment

    bar = _Bar()
    res = block_size_experiment([8 << 10, 64 << 10], total_bytes=256 << 10, repeats=1, transports=("host",), bar=bar)
    assert bar.total == 1 == bar.done and bar.started[0].startswith("link host: 2 block sizes")
    assert set(res["ceiling_gbps"]) == {"host"}


def test_the_current_step_stays_readable_when_the_step_labels_hide():
    fig = timeline_replay(_events(30), window_ms=30.0)          # 30 frames: the slider hides its step labels
    cv = fig.layout.sliders[0].currentvalue
    assert cv.visible and cv.font.color == "#333" and cv.prefix == "run time = "
