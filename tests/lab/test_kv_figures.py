"""Notebook 02's sweep figures (workbench.lab.kv_lab) as data: log-axis tick labels a learner can
read, the Pareto front drawn over the sliding-window control."""

from __future__ import annotations

import math
from itertools import pairwise

import pandas as pd
import pytest

from workbench.lab.kv_lab import kl_figure, log_ticks, pareto_figure


@pytest.mark.parametrize("lo,hi", [(0.0065, 0.07), (0.0105, 0.014), (0.3, 0.31), (2e-6, 3e-5), (2.0, 300.0)])
def test_log_ticks_label_whole_values_and_cover_the_data(lo, hi):
    vals, text = log_ticks([lo, hi, None, float("nan"), 0.0, -1.0])     # non-positive / missing: ignored
    assert len(vals) == len(text) >= 3 and vals == sorted(vals) and len(set(vals)) == len(vals)
    assert vals[0] < lo and vals[-1] > hi                               # the axis ends on a labelled tick
    for v, t in zip(vals, text):
        assert float(t) == pytest.approx(v)                             # the label is the value, not a bare mantissa
    assert all(b / a > 1.1 for a, b in pairwise(vals))             # no two labels on top of each other
    assert sum(lo <= v <= hi for v in vals) >= 1


def test_log_ticks_examples():
    assert log_ticks([0.0065, 0.07]) == ([0.005, 0.01, 0.02, 0.05, 0.1], ["0.005", "0.01", "0.02", "0.05", "0.1"])
    assert log_ticks([3e-5])[1] == ["2e-5", "3e-5", "4e-5"]
    assert log_ticks([]) == ([], []) and log_ticks([0, None]) == ([], [])


def _sweep():
    return pd.DataFrame({
        "name": ["a", "b", "c", "a-drop", "b-drop"], "reduction": [1.5, 5.4, 5.6, 7.6, 7.6],
        "rel_ppl": [-0.02, 0.011, 0.012, -0.014, -0.003], "kl": [0.007, 0.010, 0.0095, 0.045, 0.06],
        "cold_mode": ["mean", "mean", "mean", "drop", "drop"], "error": [None] * 5})


def test_pareto_front_is_drawn_over_the_control():
    fig = pareto_figure(_sweep())
    names = [t.name for t in fig.data]
    assert names == ["hot / warm / cold", "sliding-window control (cold dropped)", "Pareto front (every config)"]
    configs, control, front = fig.data
    assert list(configs.text) == ["a", "b", "c"] and list(control.text) == ["a-drop", "b-drop"]
    assert control.marker.symbol.endswith("-open")                      # hollow: the front's marker shows inside
    assert list(front.text) == ["a", "a-drop"]                          # the front here ends on a control point
    assert list(pareto_figure(_sweep().drop(columns="cold_mode")).data[0].text) == ["a", "b", "c", "a-drop", "b-drop"]


def test_kl_figure_log_axis_has_readable_ticks_and_units():
    df = _sweep()
    fig = kl_figure(df[df["cold_mode"] == "mean"], df[df["cold_mode"] == "drop"])
    y = fig.layout.yaxis
    assert y.type == "log" and "nats per token" in y.title.text
    assert list(y.ticktext) == ["0.005", "0.01", "0.02", "0.05", "0.1"]
    assert y.range[0] == pytest.approx(math.log10(0.005)) and y.range[1] == pytest.approx(math.log10(0.1))
    assert [t.marker.symbol for t in fig.data] == ["circle", "diamond-open"]
