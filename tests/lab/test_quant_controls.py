"""Notebook 05's quality-bound slider over the calibrator's measured mixes (headless, hand-made
results in the calibrator's format): the pick at every bound is the calibrator's own first-step
rule, precomputed into plotly's own slider (so it works without a kernel); and the progress
callback of functions that announce each item as it starts."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("plotly")

from workbench.lab.progress import Progress
from workbench.lab.quant_view import (
    OVER,
    VERDICT_COLORS,
    perplexity_figure,
    PICK_PREFIX,
    PICKED,
    QUALITY_BOUND_META,
    WITHIN,
    quality_bound_choices,
    quality_bound_figure,
    step_messages,
)
from workbench.quant.recommend import _pick

MIB = 2**20


def _row(key, degradation, cost, se=0.002, samples=None, assignment=None):
    row = {"key": key, "label": f"{key} layers", "kind": "uniform",
           "degradation": degradation, "degradation_se": se, "cost": cost, "cost_vs_unquantized": None,
           "assignment": assignment or {"mix": key}}
    if samples is not None:
        row.update(ms=cost, ms_min=min(samples), ms_max=max(samples), samples=samples)
    return row


def _memory():
    rows = [_row("unquantized", 0.0, 25 * MIB), _row("uniform w8a16", 0.001, 14 * MIB),
            _row("front 3", 0.012, 11 * MIB), _row("uniform w4a16:g128", 0.021, 9 * MIB),
            _row("front 5", -0.001, 16 * MIB)]
    for r in rows:
        r["cost_vs_unquantized"] = r["cost"] / (25 * MIB)
    return {"target_metric": "ppl", "objective": "memory", "candidates": rows, "max_degradation": 0.02,
            "dataset": "data/calibration/prose.jsonl"}


def _latency():
    rows = [_row("unquantized", 0.0, 2.6, samples=[2.5, 2.6, 2.7]),
            _row("uniform w8a16", 0.001, 3.3, samples=[3.2, 3.3, 3.4], assignment={"mix": "uniform w8a16"}),
            # faster than w8a16 but within the noise of it, and worse beyond 2 s.e.: w8a16 wins over it
            _row("front 3", 0.012, 2.55, samples=[2.4, 2.55, 2.75], assignment={"mix": "front 3"}),
            _row("uniform w4a16:g128", 0.021, 6.0, samples=[5.9, 6.0, 6.1])]
    for r in rows:
        r["cost_vs_unquantized"] = r["cost"] / 2.6
    return {"target_metric": "ppl", "objective": "latency", "candidates": rows, "max_degradation": 0.02,
            "dataset": "data/calibration/prose.jsonl"}


def test_memory_picks_the_smallest_measured_mix_within_each_bound():
    res = _memory()
    choices = quality_bound_choices(res)
    assert [c["bound"] for c in choices] == [0.0, 0.001, 0.012, 0.02, 0.021]  # where the pick can change, and the limit
    assert [c["limit"] for c in choices] == [False, False, False, True, False]
    assert [c["pick"]["key"] for c in choices] == ["front 5", "uniform w8a16", "front 3", "front 3",
                                                   "uniform w4a16:g128"]
    assert choices[1]["within"] == {"unquantized": True, "uniform w8a16": True, "front 3": False,
                                    "uniform w4a16:g128": False, "front 5": True}


def test_latency_uses_the_calibrators_rule_with_its_noise_tie_break():
    res = _latency()
    choices = quality_bound_choices(res, noise=0.05)
    for c in choices:        # the calibrator's own first step, on the mixes within the bound
        ok = [r for r in res["candidates"] if r["degradation"] <= c["bound"]]
        assert c["pick"]["key"] == _pick(ok, "latency", 0.05)["key"]
    at = {c["bound"]: c["pick"]["key"] for c in choices}
    # front 3 is the fastest median but not beyond the noise of the unquantized model, which degrades less
    assert at[0.012] == "unquantized" and at[0.0] == "unquantized"


def test_quality_bound_slider_moves_the_pick_and_its_cost_offline():
    mem, lat = _memory(), _latency()
    fig = quality_bound_figure([mem, lat], noise=0.05)
    doc = json.loads(fig.to_json())
    layout = doc["layout"]
    assert layout["meta"] == QUALITY_BOUND_META
    slider = layout["sliders"][0]
    bounds = sorted({0.0, 0.001, 0.012, 0.02, 0.021})
    assert len(slider["steps"]) == len(bounds) and slider["active"] == bounds.index(0.02)    # starts at the limit
    texts = [s["args"][1]["annotations[0].text"] for s in slider["steps"]]
    assert all(t.startswith(f"<b>{PICK_PREFIX}</b>") for t in texts)
    assert layout["annotations"][0]["text"] == texts[slider["active"]]
    assert "front 5" in texts[0] and "25.00 MiB" not in texts[0] and "16.00 MiB (0.64x)" in texts[0]
    assert "<b>front 3</b>" in texts[3] and "11.00 MiB (0.44x)" in texts[3] and "ppl +1.20 % ± 0.20" in texts[3]
    assert "its decode step 2.55 ms" in texts[3]                 # the latency search measured the same mix
    assert "2.60 ms a decode step" in texts[3]                   # the latency pick: unquantized
    # each step restyles both panels: mixes' colours, the bound line, the star
    for s, b in zip(slider["steps"], bounds):
        data, _, idx = s["args"]
        assert len(idx) == 6 and all(len(v) == len(idx) for v in data.values())
        assert data["y"][1] == [100 * b, 100 * b] and data["y"][4] == [100 * b, 100 * b]
        colors = data["marker.color"][0]
        assert colors == [WITHIN if r["degradation"] <= b else OVER for r in mem["candidates"]]
        assert data["marker.color"][2] == PICKED
    last = slider["steps"][-1]["args"][0]
    assert last["x"][2] == [9.0] and last["y"][2] == [pytest.approx(2.1)]      # w4a16 is the smallest at +2.1 %
    assert doc["data"][0]["xaxis"] == "x" and doc["data"][3]["xaxis"] == "x2"
    one = quality_bound_figure(lat)                              # one result: one panel
    assert len(json.loads(one.to_json())["layout"]["sliders"][0]["steps"]) == 5     # 4 mixes and the limit


def test_step_messages_count_an_item_done_when_the_next_starts():
    shown = []
    bar = Progress(3, "recipes", display=shown.append)
    say = step_messages(bar)
    say("quality: fp32")
    assert bar.done == 0 and "recipes 1/3: quality: fp32" in bar.text()
    say("quality: bf16")
    say("quality: w8a16")
    assert bar.done == 2 and "3/3: quality: w8a16" in bar.text()
    bar.advance()
    assert bar.done == 3


def test_perplexity_bars_are_coloured_by_their_verdict_with_a_key():
    rows = [{"recipe": "w8a16", "rel_ppl": 0.001, "rel_ppl_se": 0.002},      # within noise
            {"recipe": "w4a16:pt", "rel_ppl": 0.06, "rel_ppl_se": 0.01},    # worse beyond 2 s.e.
            {"recipe": "bf16", "rel_ppl": -0.03, "rel_ppl_se": 0.01},       # better beyond 2 s.e.
            {"recipe": "w4a8", "rel_ppl": 0.02}]                            # no standard error
    fig = perplexity_figure(rows)
    want = ["within noise of fp32 (2 s.e.)", "worse than fp32 (beyond 2 s.e.)", "better than fp32 (beyond 2 s.e.)",
            "no standard error"]
    assert list(fig.data[0].marker.color) == [VERDICT_COLORS[v] for v in want]
    assert [t.name for t in fig.data[1:]] == want                              # the key: one entry per colour used
    assert [t.marker.color for t in fig.data[1:]] == [VERDICT_COLORS[v] for v in want]
    assert fig.layout.legend.y == 1.0 and fig.layout.legend.orientation == "h"  # above the plot, over no bar
