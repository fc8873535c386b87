"""Notebook 04's figures, checked as data (no browser): the load dashboard's status line (fixed
height, red only for a count that is not 0), its axes and legend, the window-sweep figure's
secondary axis, the scheduler timeline's per-row legends and height, and the ``live`` switch of
the load ramp (display the dashboard or not)."""

from __future__ import annotations

import re

import pandas as pd
import pytest

pytest.importorskip("plotly")
pytest.importorskip("ipywidgets")

from workbench.bench.sched_experiments import ramp_stages  # noqa: E402
from workbench.lab import load_views as lv  # noqa: E402
from workbench.lab import sched_lab  # noqa: E402
from workbench.lab import sched_timeline as st  # noqa: E402

STATUS = {"elapsed": 3.25, "stage": "ramp", "target": 21.1, "mode": "poisson", "sent": 40, "ok": 31, "error": 0,
          "rejected": 0, "cancelled": 0, "in_flight": 9}


def _lines(value: str) -> list[str]:
    return re.findall(r"<div style='([^']*)'[^>]*>(.*?)</div>", value)


def test_a_count_is_red_only_when_it_is_not_zero():
    assert lv.count_html("rejected", 0, alert=True) == "rejected 0"
    assert lv.count_html("rejected", 3, alert=True) == f"<span style='color:{lv.ALERT}'>rejected 3</span>"
    assert lv.count_html("sent", 3) == "sent 3"                    # not an alert count: never red
    dash = lv.LatencyDashboard()
    dash.status = dict(STATUS)
    assert lv.ALERT not in dash._status_html()                      # nothing rejected, no error: no red
    dash.status.update(rejected=2)
    assert f"<span style='color:{lv.ALERT}'>rejected 2</span>" in dash._status_html()
    assert "errors 0" in dash._status_html()
    dash.status.update(rejected=0, error=1)
    assert f"<span style='color:{lv.ALERT}'>errors 1</span>" in dash._status_html()


def test_the_status_line_has_a_fixed_height_whatever_it_says():
    dash = lv.LatencyDashboard(name="load-dashboard")
    assert {"wb-live", "wb-live-load-dashboard"} <= set(dash.widget._dom_classes)
    assert dash.widget.children == (dash.label, dash.fig)
    assert dash.label.layout.height == f"{2 * lv.STATUS_LINE_PX}px" and dash.label.layout.overflow == "hidden"
    waiting = dash.label.value
    dash.status = dict(STATUS, stage="a stage with a name far too long for one line " * 4,
                       slo={"state": "half_open", "trips": 3})
    dash.metrics_error = "metrics_fn failed: ConnectError: " + "x" * 300
    dash.data["ttft_p95"].append(123.4)
    for value in (waiting, dash._status_html()):
        lines = _lines(value)
        assert len(lines) == 2                                      # always two lines, never more
        for style, _ in lines:
            assert "white-space:nowrap" in style and "text-overflow:ellipsis" in style
            assert f"height:{lv.STATUS_LINE_PX}px" in style
    head, counts = (text for _, text in _lines(dash._status_html()))
    assert "HALF-OPEN" in head and "TTFT P95 123.4 ms" in head and "metrics_fn failed" in head
    assert counts.startswith("sent 40") and "in flight 9" in counts
    # the full text of a line is its tooltip, without the markup
    assert "title='3.2 s stage a stage" in lv.status_lines_html(["<b>3.2 s</b> stage a stage"])


def test_dashboard_axes_have_ticks_of_their_own_quantity_and_one_compact_legend():
    dash = lv.LatencyDashboard()
    fig = dash.static_figure()
    kv = fig.layout.yaxis4
    state = fig.layout.yaxis5
    assert state.overlaying == "y4" and state.side == "right"
    assert "%" in kv.title.text and kv.ticktext is None and list(kv.range) == [0, 105]
    assert "%" not in state.title.text and list(state.ticktext) == ["closed", "half-open", "open"]
    # one horizontal legend above the rows; one entry per percentile for the TTFT and ITL rows
    assert fig.layout.legend.orientation == "h" and fig.layout.legend.y > 1
    shown = [t.name for t in fig.data if t.showlegend is not False]
    assert shown[:3] == ["P50", "P95", "P99"] and len(shown) == len(fig.data) - 3
    by_key = dict(zip((k for k, *_ in lv.TRACES), fig.data, strict=True))
    for p in ("p50", "p95", "p99"):
        ttft, itl = by_key[f"ttft_{p}"], by_key[f"itl_{p}"]
        assert ttft.legendgroup == itl.legendgroup == p and ttft.line.color == itl.line.color
        assert itl.showlegend is False and "ITL" in itl.hovertemplate and "TTFT" in ttft.hovertemplate
    # a FigureWidget draws nothing for a figure with a second legend: the live figure has one
    assert all(t.legend is None for t in dash.fig.data) and "legend2" not in dash.fig.layout.to_plotly_json()
    assert len({t.name for t in fig.data}) == len(fig.data) == len(lv.TRACES)


def test_the_live_figure_is_fitted_to_its_cell_at_most_every_fit_every_s():
    """A FigureWidget keeps the width it was first laid out at (often plotly's 700 px default, in
    a VBox); the dashboard re-sends ``autosize`` with its redraws, paced by its clock."""
    now = [0.0]
    dash = lv.LatencyDashboard(max_hz=10, clock=lambda: now[0])
    sent = []
    dash.fig._send_relayout_msg = lambda data, source_view_id=None: sent.append(data)
    for i in range(20):                      # 5 s of redraws, 4 a second
        now[0] = i * 0.25
        dash.update(t=now[0])
    assert dash.redraws == 20 and sent == [{"autosize": True}] * 3      # at 0, 2 and 4 s
    now[0] = 4.5
    dash.update(t=4.5, force=True)           # the run's last redraw always fits
    assert len(sent) == 4


def test_window_sweep_figure_secondary_axis_has_round_ticks_from_zero():
    table = pd.DataFrame({"window_ms": [0.0, 5.0, 20.0, 50.0], "queue_ms_p95": [1743.6, 1483.4, 1350.8, 1646.3],
                          "ttft_ms_p95": [2210.0, 1880.0, 2120.0, 2240.0],
                          "mean_batch": [4.25, 3.905, 4.014, 4.07]}).set_index("window_ms")
    fig = sched_lab.window_sweep_figure(table, rate=5.0)
    ms, batch = fig.layout.yaxis, fig.layout.yaxis2
    assert batch.overlaying == "y" and batch.tickmode == "auto" and batch.tickformat == "~g"
    assert batch.range[0] == 0 and batch.range[1] >= 4.25 and "batch" in batch.title.text
    assert ms.rangemode == "tozero" and ms.title.text == "ms"
    assert list(fig.layout.xaxis.tickvals) == [0.0, 5.0, 20.0, 50.0]
    assert [t.name for t in fig.data][:2] == ["queue wait P95", "TTFT P95"] and fig.data[2].yaxis == "y2"
    assert list(fig.data[2].y) == [4.25, 3.905, 4.014, 4.07]
    assert fig.layout.legend.orientation == "h"


def _frame(n_requests: int) -> pd.DataFrame:
    """Request i arrives at step i (an 8-token prefill), then decodes two steps."""
    rows = []
    for s in range(n_requests + 2):
        ids = [i for i in range(max(0, s - 2), min(s + 1, n_requests))]
        prefill = [i == s for i in ids]
        toks = [8 if p else 1 for p in prefill]
        rows.append(dict(step=s, start=0.01 * s, schedule_s=1e-4, model_s=0.01, post_s=1e-4, num_seqs=len(ids),
                         prefill_tokens=8 * sum(prefill), decode_tokens=len(ids) - sum(prefill),
                         request_ids=tuple(f"req-{i}" for i in ids), request_tokens=tuple(toks),
                         request_prefill=tuple(prefill)))
    return pd.DataFrame(rows)


def test_requests_row_height_rule():
    assert st.requests_row_px(1) == 150 and st.requests_row_px(16) == 16 * st.ROW_PX
    assert st.requests_row_px(40) == 640 and st.requests_row_px(400) == 640


def test_timeline_has_one_legend_per_row_and_grows_with_the_requests():
    small, big = st.scheduler_timeline(_frame(4), title="t"), st.scheduler_timeline(_frame(30), title="t")
    assert big.layout.height - small.layout.height == st.requests_row_px(30) - st.requests_row_px(4)
    rows = {"prefill tokens": "legend", "decode tokens": "legend", "scheduler": "legend2", "model": "legend2",
            "after sampling": "legend2", "prefilling": "legend3", "decoding": "legend3"}
    assert {t.name: t.legend or "legend" for t in big.data} == rows
    for name in ("legend", "legend2", "legend3"):
        leg = big.layout[name]
        assert leg.orientation == "h" and leg.xanchor == "right" and leg.traceorder == "normal"
    # each legend sits on the line of its row's title, the title moved to the left
    for i, name in enumerate(("legend", "legend2", "legend3")):
        assert big.layout[name].y == pytest.approx(big.layout.annotations[i].y)
        assert big.layout.annotations[i].xanchor == "left"
    assert big.layout.title.text == "t" and "32 steps" in big.layout.title.subtitle.text
    assert "scheduler took" in big.layout.title.subtitle.text


@pytest.mark.parametrize("live", [True, False])
def test_load_ramp_displays_the_dashboard_only_when_live(random_llm, monkeypatch, live):
    shown = []
    monkeypatch.setattr(lv.LatencyDashboard, "display", lambda self: shown.append(self) or self)
    warm, _, stages = ramp_stages(8.0, durations=(0.3, 0.1, 0.3, 0.1))
    ramp = sched_lab.load_ramp(random_llm, stages, warm, max_tokens=2, live=live,
                               guard_config={"min_samples": 4, "window": 8})
    dash = ramp["dashboard"]
    assert shown == ([ramp["views"]["no guard"], dash] if live else [])     # each ramp's, from its start (issue 39)
    assert len(dash.data["t"]) >= 1 and len(dash.static_figure().data) == len(lv.TRACES)   # recorded either way
