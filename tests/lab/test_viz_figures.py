"""The static figures of workbench.lab.viz: label placement, panels, the hooks' cost wording.

Logic only (where labels go, which axis a trace is on, what a title says), not pixels.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("plotly")

from workbench.lab import viz
from workbench.lab.viz import (
    breakdown_bar,
    comparison_bar,
    describe_hook_overhead,
    hook_overhead_text,
    label_levels,
    latency_histogram,
)


# ---- label_levels -------------------------------------------------------------------------------
def test_labels_far_apart_share_the_first_row():
    assert label_levels([13.6, 19.1, 22.0], min_gap=2.0) == [0, 0, 0]


def test_labels_at_the_same_x_each_get_a_row():
    assert label_levels([4.8, 4.8, 4.8], min_gap=0.1) == [0, 1, 2]


def test_only_the_close_pair_is_split_and_a_freed_row_is_reused():
    # P50 far left; P95 and P99 close together; a fourth label far right goes back to row 0
    assert label_levels([10.0, 19.0, 19.5, 30.0], min_gap=2.0) == [0, 0, 1, 0]


def test_levels_come_back_in_the_order_given():
    assert label_levels([19.5, 10.0, 19.0], min_gap=2.0) == [1, 0, 0]


def test_a_gap_of_exactly_min_gap_is_enough():
    assert label_levels([0.0, 2.0, 4.0], min_gap=2.0) == [0, 0, 0]


def test_label_levels_edge_cases():
    assert label_levels([], min_gap=1.0) == []
    assert label_levels([1.0, 1.0], min_gap=0.0) == [0, 0]
    with pytest.raises(ValueError, match="min_gap"):
        label_levels([1.0], min_gap=-1.0)


def test_no_two_labels_on_a_row_are_closer_than_min_gap():
    rng = np.random.default_rng(0)
    for _ in range(50):
        xs = list(rng.uniform(0, 10, size=int(rng.integers(1, 8))))
        levels = label_levels(xs, min_gap=1.5)
        for i in range(len(xs)):
            for j in range(i + 1, len(xs)):
                if levels[i] == levels[j]:
                    assert abs(xs[i] - xs[j]) >= 1.5
        # and a label only goes up a row when the rows below it are taken at its x
        for i, lv in enumerate(levels):
            for below in range(lv):
                assert any(levels[j] == below and abs(xs[j] - xs[i]) < 1.5 for j in range(len(xs)) if j != i)


# ---- latency_histogram ---------------------------------------------------------------------------
def _requests(itl_ms, ttft_ms):
    return [SimpleNamespace(itl=[g / 1e3 for g in gaps], ttft=t / 1e3) for gaps, t in zip(itl_ms, ttft_ms)]


def _percentile_labels(fig):
    return {a.text.split()[0]: a for a in fig.layout.annotations if a.text.startswith("P")}


def test_close_percentiles_are_stacked_and_far_ones_are_not():
    # one slow gap stretches the axis to 20 ms; P50 / P95 / P99 sit within 0.2 ms of each other
    tight = _requests([[4.80] * 97 + [4.805, 4.81, 20.0]], [50.0])
    labels = _percentile_labels(latency_histogram(tight))
    assert set(labels) == {"P50", "P95", "P99"}
    assert len({a.yshift for a in labels.values()}) == 3

    gaps = [5.0] * 60 + [10.0] * 34 + [15.0] * 4 + [30.0] * 2      # P50 5, P95 15, P99 30 ms: far apart
    labels = _percentile_labels(latency_histogram(_requests([gaps], [60.0])))
    assert len({a.yshift for a in labels.values()}) == 1
    assert [labels[p].text for p in ("P50", "P95", "P99")] == ["P50 5.00 ms", "P95 15.00 ms", "P99 30.00 ms"]


def test_ttft_has_its_own_panel_and_x_axis():
    fig = latency_histogram(_requests([[5.0, 5.1, 5.2]] * 3, [50.0, 51.0, 53.0]))
    hist = next(t for t in fig.data if t.type == "histogram")
    ttft = next(t for t in fig.data if t.name == "TTFT")
    assert hist.xaxis != ttft.xaxis
    assert list(ttft.x) == pytest.approx([50.0, 51.0, 53.0])
    assert max(hist.x) < 10          # no TTFT on the histogram's axis
    ax = fig.layout[ttft.xaxis.replace("x", "xaxis")]
    assert "time to first token" in ax.title.text and "median 51.0 ms" in ax.title.text
    # the percentile lines span only the histogram's panel
    assert all(s.xref == hist.xaxis for s in fig.layout.shapes)


def test_histogram_without_ttft_or_without_gaps():
    only_gaps = latency_histogram([SimpleNamespace(itl=[0.005, 0.006], ttft=None)])
    assert [t.type for t in only_gaps.data] == ["histogram"]
    only_ttft = latency_histogram(_requests([[]], [40.0]))
    assert [t.name for t in only_ttft.data] == ["TTFT"]
    assert not _percentile_labels(only_ttft)


# ---- the hooks' cost ----------------------------------------------------------------------------
def _attrs(plain, hooked):
    return {"plain_step_ms": plain, "hooked_step_ms": hooked, "hook_overhead_ms": hooked - plain,
            "hook_overhead_pct": 100 * (hooked - plain) / plain, "steps": 16, "device": "cpu", "dtype": "float32"}


def test_a_negative_overhead_is_within_noise_and_not_printed_as_a_cost():
    line = describe_hook_overhead(_attrs(10.921, 10.713), noise=0.05)
    assert "within noise" in line and "too small to measure" in line
    assert "the hooks add" not in line and "-0.208" not in line
    assert "plain step 10.921 ms, hooked step 10.713 ms" in line
    assert hook_overhead_text(_attrs(10.921, 10.713), noise=0.05) == "hooks' cost within noise"


def test_a_negative_overhead_beyond_the_floor_says_the_run_was_noisy():
    line = describe_hook_overhead(_attrs(10.0, 9.0), noise=0.05)
    assert "within noise" in line and "ran 10% faster" in line and "noisier than the 5% floor" in line


def test_a_small_positive_overhead_inside_the_floor_is_within_noise():
    line = describe_hook_overhead(_attrs(10.0, 10.3), noise=0.05)
    assert "within noise" in line and "+3%" in line and "inside the 5% noise floor" in line


def test_an_overhead_beyond_the_floor_is_stated():
    a = _attrs(10.71, 12.65)
    assert describe_hook_overhead(a, noise=0.05).startswith(
        "plain step 10.710 ms, hooked step 12.650 ms: the hooks add 1.940 ms (+18%) per step")
    assert hook_overhead_text(a, noise=0.05) == "+18% for the hooks"
    assert "within noise" in hook_overhead_text(a, noise=0.25)    # a noisier machine: same numbers, no claim


def _breakdown(plain, hooked):
    comps = ["embedding", "attention", "mlp", "norm", "lm_head", "sampling", "other"]
    df = pd.DataFrame({"ms": [0.1, 2.0, 1.5, 0.6, 0.7, 0.1, 5.0], "share": [0.01, 0.2, 0.15, 0.06, 0.07, 0.01, 0.5],
                       "calls_per_step": [1] * 7}, index=pd.Index(comps, name="component"))
    df.attrs.update(_attrs(plain, hooked))
    return df


def test_breakdown_subtitle_uses_the_noise_rule():
    fig = breakdown_bar(_breakdown(10.921, 10.713), noise=0.05)
    assert fig.layout.title.text == "Decode step breakdown (hooked)"
    sub = fig.layout.title.subtitle.text
    assert "within noise" in sub and "-" not in sub.split("(")[-1]
    fig = breakdown_bar(_breakdown(10.71, 12.65), noise=0.05)
    assert fig.layout.title.subtitle.text.endswith("(+18% for the hooks)")
    assert breakdown_bar(_breakdown(10.0, 12.0), title="mine").layout.title.text == "mine"


# ---- comparison_bar -----------------------------------------------------------------------------
def test_comparison_panels_take_readable_titles_and_no_red_green():
    df = pd.DataFrame({"ttft_ms_p50": [31.7, 45.9], "decode_tokens_per_s_p50": [49.5, 41.4]},
                      index=["workbench", "transformers.generate"])
    fig = comparison_bar(df, labels={"ttft_ms_p50": "TTFT p50 (ms; lower is better)"})
    titles = [a.text for a in fig.layout.annotations]
    assert titles == ["TTFT p50 (ms; lower is better)", "decode_tokens_per_s_p50"]
    colours = {c for t in fig.data for c in t.marker.color}
    assert colours == set(viz.PALETTE[:2])


# ---- LatencyStreamView --------------------------------------------------------------------------
def test_stream_view_widget_is_findable_and_its_static_median_label_sits_in_the_margin():
    pytest.importorskip("ipywidgets")
    view = viz.LatencyStreamView()
    assert {"wb-live", "wb-live-latency-stream"} <= set(view.widget._dom_classes)
    assert view.fig in view.widget.children          # the test reads the trace data inside the VBox
    view.times, view.pieces, view.arrival = [1.0, 1.01, 1.03, 1.04], ["a", "b", "c", "d"], 0.95
    fig = view.static_figure()
    (median,) = fig.layout.annotations
    assert median.xref == "x domain" and median.x == 1 and median.xanchor == "left"
    assert "TPOT 13.33 ms" in fig.layout.title.text and "TTFT 50.0 ms" in fig.layout.title.text   # gaps 10, 20, 10 ms


class _FakeLLM:
    """Yields ``n`` token events 1 ms apart, like ``LLM.stream``."""

    tokenizer = True

    def __init__(self, n: int = 6):
        self.n = n

    def stream(self, prompt, params=None, arrival_time=None, output=None):
        t = arrival_time
        for i in range(self.n):
            t += 1e-3
            yield SimpleNamespace(time=t, text=f" t{i}", token_id=i, finished=i == self.n - 1)


def test_stream_view_keeps_the_whole_figure_in_the_widget_model():
    # a view drawn after the stream (a slow browser) reads _widget_data, not the deltas
    pytest.importorskip("ipywidgets")
    view = viz.LatencyStreamView()
    view.run(_FakeLLM(6), "prompt", display=False)
    (trace,) = view.fig._widget_data
    assert list(trace["x"]) == [1, 2, 3, 4, 5]
    assert list(trace["y"]) == pytest.approx(view.itl_ms)
    assert view.fig._widget_layout["title"]["text"] == "Per-token latency (live)"


def test_stream_view_records_a_frame_per_token_and_its_replay_shows_the_end_until_played():
    pytest.importorskip("ipywidgets")
    from workbench.lab.replay import has_replay

    view = viz.LatencyStreamView()
    view.run(_FakeLLM(6), "prompt", SimpleNamespace(max_tokens=6), display=False)
    frames = view.recorder.frames
    assert len(frames) == 6 and [f.t_ms for f in frames] == pytest.approx([1, 2, 3, 4, 5, 6])   # the engine's clock
    assert frames[0].data[0]["x"] == [] and frames[-1].data[0]["x"] == [1, 2, 3, 4, 5]
    assert "token 6" in frames[-1].label and "TTFT" in frames[0].label
    fig = view.replay_figure()
    assert has_replay(json.loads(fig.to_json())) and len(fig.frames) == 6
    assert fig.layout.sliders[0].active == 5 and list(fig.data[0].x) == [1, 2, 3, 4, 5]     # the end, until ▶
    assert list(fig.layout.yaxis.range) == pytest.approx([0, 1.15]) and fig.layout.xaxis.range[1] >= 6
    assert view.record_seconds > 0 and "µs per token" in view.recording_text()
    quiet = viz.LatencyStreamView(record=False)
    quiet.run(_FakeLLM(3), "prompt", display=False)
    assert quiet.replay_figure() is None and quiet.recorder.frames == []


def test_replay_at_end_shows_the_last_frame():
    import plotly.graph_objects as go

    from workbench.lab.replay import Recorder, replay_figure

    rec = Recorder()
    for i in range(1, 4):
        rec.add([{"y": [i] * i}], label=str(i), layout={"title": {"text": f"frame {i}"}})
    fig = replay_figure(go.Figure(go.Scatter(y=[])), rec.frames)
    assert list(fig.data[0].y) == [1] and fig.layout.sliders[0].active == 0
    fig = viz.replay_at_end(fig)
    assert list(fig.data[0].y) == [3, 3, 3] and fig.layout.sliders[0].active == 2 and fig.layout.title.text == "frame 3"
    assert viz.replay_at_end(go.Figure()).frames == ()
