"""Notebook 06's views from hand-made inputs in the formats the ablation produces (headless):
the waterfall's floating bars, colours by verdict, hatching and noise bands, skipped layers with
their reason; the per-configuration and memory bars."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("plotly")

import pandas as pd

from workbench.lab.e2e_view import (
    BASE,
    BETTER,
    NOISE,
    SKIP,
    WORSE,
    ablation_figure,
    memory_figure,
    step_color,
    waterfall_figure,
)

STEPS = [
    {"kind": "start", "layer": "baseline", "label": "baseline", "config": "baseline", "value": 800.0, "lo": 700.0,
     "hi": 900.0},
    {"kind": "step", "layer": "paged", "label": "paged KV pool", "config": "+paged", "value": 900.0, "lo": 850.0,
     "hi": 950.0, "prev": 800.0, "delta": 100.0, "rel": 0.125, "verdict": "within noise (1.13x, ranges overlap)",
     "winner": None, "within_noise": True, "noise": 0.1},
    {"kind": "step", "layer": "prefix_cache", "label": "prefix cache", "config": "+paged +prefix_cache", "value": 450.0,
     "lo": 420.0, "hi": 480.0, "prev": 900.0, "delta": -450.0, "rel": -0.5,
     "verdict": "+paged +prefix_cache lower by 2.00x", "winner": "+paged +prefix_cache", "within_noise": False,
     "noise": 0.1},
    {"kind": "skipped", "layer": "compile", "label": "compile", "config": None,
     "reason": "LLMEngine: compile / cuda_graphs run decode steps over static contiguous KV buffers"},
    {"kind": "step", "layer": "quant", "label": "quant w8a16", "config": "stack: quant", "value": 600.0, "lo": 580.0,
     "hi": 640.0, "prev": 450.0, "delta": 150.0, "rel": 1 / 3, "verdict": "+paged +prefix_cache lower by 1.33x",
     "winner": "+paged +prefix_cache", "within_noise": False, "noise": 0.1},
    {"kind": "total", "layer": "stack", "label": "the stack", "config": "stack: quant", "value": 600.0, "prev": 800.0,
     "delta": -200.0, "rel": -0.25, "verdict": "stack: quant lower by 1.33x", "winner": "stack: quant",
     "within_noise": False, "noise": 0.1},
]


def test_step_colours_follow_the_verdicts():
    assert [step_color(s) for s in STEPS] == [BASE, NOISE, BETTER, SKIP, WORSE, BETTER]
    higher = dict(STEPS[2], delta=450.0)              # for a higher-is-better metric a rise beyond noise is better
    assert step_color(higher, lower_is_better=False) == BETTER and step_color(STEPS[2], lower_is_better=False) == WORSE


def test_waterfall_floats_each_step_from_the_previous_level():
    fig = waterfall_figure(STEPS, metric="TTFT p95", unit="ms")
    bars = fig.data[0]
    assert list(bars.x) == ["baseline", "+paged KV pool", "+prefix cache", "+compile", "+quant w8a16", "the stack"]
    assert list(bars.base) == [0.0, 800.0, 450.0, 450.0, 450.0, 0.0]
    assert list(bars.y) == [800.0, 100.0, 450.0, 0.0, 150.0, 600.0]
    assert list(bars.marker.color) == [BASE, NOISE, BETTER, SKIP, WORSE, BETTER]
    assert list(bars.marker.pattern.shape) == ["", "/", "", "", "", ""]          # hatched: within noise
    assert "within noise" in bars.text[1] and bars.text[3] == "not in the stack" and bars.text[2] == "-50 %"
    assert "LLMEngine: compile / cuda_graphs" in bars.hovertext[3]              # the engine's reason, on hover
    # the noise floor: one band per step, the previous median +- the floor
    bands = [s for s in fig.layout.shapes if s.type == "rect"]
    assert [(b.y0, b.y1) for b in bands] == [pytest.approx((720.0, 880.0)), pytest.approx((810.0, 990.0)),
                                             pytest.approx((405.0, 495.0))]
    runs = next(t for t in fig.data if t.name == "runs (min..max)")
    assert list(runs.y) == [800.0, 900.0, 450.0, 600.0]
    assert list(runs.error_y.array) == [100.0, 50.0, 30.0, 40.0] and list(runs.error_y.arrayminus) == [100.0, 50.0,
                                                                                                       30.0, 20.0]
    cross = next(t for t in fig.data if t.name == "not in the stack")
    assert list(cross.x) == ["+compile"] and list(cross.y) == [450.0]
    json.loads(fig.to_json())                                                     # what save_results stores


def test_waterfall_of_the_baseline_alone():
    fig = waterfall_figure(STEPS[:1] + [STEPS[3]], metric="TTFT p95")
    assert list(fig.data[0].y) == [800.0, 0.0] and not [s for s in fig.layout.shapes if s.type == "rect"]


def test_ablation_and_memory_figures():
    summary = pd.DataFrame({
        "config": ["baseline", "+paged", "+quant"], "ttft_ms_p95": [800.0, 900.0, 500.0],
        "vs baseline: TTFT p95": ["-", "baseline lower by 1.20x", "+quant lower by 1.60x"],
        "kv_bytes": [15 * 2**20, 48 * 2**20, 15 * 2**20], "kv_used_bytes": [15 * 2**20] * 3,
        "weights_bytes": [25 * 2**20, 25 * 2**20, 12 * 2**20]}).set_index("config")
    fig = ablation_figure(summary, "ttft_ms_p95", "TTFT p95", "ms")
    assert list(fig.data[0].marker.color) == [BASE, WORSE, BETTER]
    assert fig.layout.shapes[0].y0 == 800.0                                      # the baseline's line
    mem = memory_figure(summary)
    assert [t.name for t in mem.data][:2] == ["weights", "KV held"] and list(mem.data[1].y) == [15.0, 48.0, 15.0]
    assert list(mem.data[2].y) == [40.0, 40.0, 27.0]
