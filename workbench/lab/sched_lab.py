"""Notebook 04's views and controls: the load ramp with a dashboard on each of its runs, live from
the ramp's start and replayed when it ends (:func:`load_ramp`; the ramp itself, a measurement, is
:func:`workbench.bench.sched_experiments.load_ramp`); the micro-batch window sweep (:func:`window_sweep_figure`,
one rate) and the window x rate grid with a dropdown that picks which point's timeline is shown
(:func:`sweep_picker_figure`: plotly's own menu, so it works offline); and tables a learner can read
(:func:`readable`, :func:`metrics_table`: units in the headers, ms to one decimal, "—" for a missing
value).  The scheduler's measurements are in :mod:`workbench.bench.sched_experiments` and
:mod:`workbench.bench.sched`.
"""

from __future__ import annotations

from workbench.bench import sched_experiments as sx
from workbench.errors import ConfigError


RAMP_TITLES = {"no guard": "ramp without a guard", "SLO guard": "ramp with the SLO guard (factor 2)"}


def load_ramp(llm, stages, warm: float, max_tokens: int = 16, window_ms: float = 0.0, seed: int = 3,
              guard_config: dict | None = None, dashboard: bool = True, max_num_seqs: int = 16,
              max_num_batched_tokens: int = 256, live: bool = True, progress: bool = True) -> dict:
    """:func:`workbench.bench.sched_experiments.load_ramp` (the same ramp without and with the SLO
    guard; see there for what it returns) with a
    :class:`~workbench.lab.load_views.LatencyDashboard` on *each* run when ``dashboard``.

    With ``live`` (a notebook run by hand) each dashboard is displayed before its run starts, so
    the view is live from the ramp's first second, and is replaced, when its run ends, by its
    replay (a plain plotly figure with play / pause / speed and a scrubber over the recorded
    frames: a saved notebook reopens with it).  Without ``live`` (a batch run) no widget is made;
    the same frames are recorded and each replay is displayed when its run ends.  ``progress``: a
    :class:`~workbench.lab.progress.Progress` bar of the two ramps (which one, its stage, counts).

    Adds to the result: ``replays`` (run name -> replay figure) and ``record_cost`` (run name ->
    a line: frames, µs a frame and per event observed)."""
    from workbench.lab.progress import Progress

    def watch(run, target, guard):
        from workbench.lab.load_views import LatencyDashboard

        name = "SLO guard" if guard is not None else "no guard"
        dash = LatencyDashboard(metrics_fn=target.metrics, guard=guard, live="svg" if live else False,
                                title=RAMP_TITLES[name]).attach(run)
        if live:
            dash.display()
        return dash

    bar = Progress(2, "ramps") if progress else None
    try:
        out = sx.load_ramp(llm, stages, warm, max_tokens=max_tokens, window_ms=window_ms, seed=seed,
                           guard_config=guard_config, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, watch=watch if dashboard else None,
                           progress=bar)
    finally:
        if bar is not None:
            bar.close()
    views = {k: v for k, v in out["views"].items() if v is not None}
    out["replays"] = {k: v.replay_fig for k, v in views.items()}
    out["record_cost"] = {k: v.record_cost_text() for k, v in views.items()}
    return out


def window_sweep_figure(table, rate: float):
    """The micro-batch window sweep: queue wait and TTFT P95 (ms, left axis) and the mean batch
    size (right axis) against the window.  ``table``: indexed by ``window_ms`` with columns
    ``queue_ms_p95``, ``ttft_ms_p95``, ``mean_batch``.  Both axes start at 0 (a change of a few
    percent between single replays is not drawn as a cliff), the x ticks are the windows
    measured, and the right axis has ticks of its own (a secondary axis otherwise takes the
    left axis's tick positions: 3.924, 4.002, ...)."""
    from plotly.subplots import make_subplots

    windows = [float(w) for w in table.index]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for col, name, color in (("queue_ms_p95", "queue wait P95", "#0072B2"), ("ttft_ms_p95", "TTFT P95", "#E69F00")):
        fig.add_scatter(x=windows, y=table[col].tolist(), name=name, mode="lines+markers", line=dict(color=color),
                        hovertemplate=f"window %{{x:g}} ms: {name} %{{y:.1f}} ms<extra></extra>")
    fig.add_scatter(x=windows, y=table["mean_batch"].tolist(), name="mean batch size (right axis)",
                    mode="lines+markers", line=dict(color="#009E73", dash="dot"), secondary_y=True,
                    hovertemplate="window %{x:g} ms: mean batch %{y:.2f}<extra></extra>")
    top = max(1.0, float(table["mean_batch"].max()))
    fig.update_yaxes(title_text="ms", rangemode="tozero", secondary_y=False)
    fig.update_yaxes(title_text="mean batch size (sequences)", tickmode="auto", nticks=6, tickformat="~g",
                     range=[0, 1.15 * top], showgrid=False, secondary_y=True)
    fig.update_xaxes(title_text="micro-batch window (ms)", tickmode="array", tickvals=windows,
                     ticktext=[f"{w:g}" for w in windows])
    fig.update_layout(title=f"micro-batch window sweep at {rate:g} requests/s (one replay per window)", height=400,
                      margin=dict(l=60, r=70, t=80, b=50),
                      legend=dict(orientation="h", x=0, xanchor="left", y=1.02, yanchor="bottom"))
    return fig


# ---- the window x rate sweep: pick a point, see its timeline -----------------------------------------
def _point_name(p: dict) -> str:
    return f"window {p['window_ms']:g} ms at {p['rate']:g} req/s"


def _point_title(p: dict) -> str:
    return (f"{_point_name(p)}: TTFT P95 {p['ttft_ms_p95']:,.1f} ms, queue wait P95 {p['queue_ms_p95']:,.1f} ms, "
            f"mean batch {p['mean_batch']:.2f}, {p['steps']} steps")


def _sweep_traces(points: list[dict], rates: list[float], colour: dict) -> list[tuple]:
    """Row 1 of :func:`sweep_picker_figure`, as (trace, row): TTFT P95 (solid) and queue wait P95
    (dashed) against the window, one colour per rate."""
    import plotly.graph_objects as go

    out = []
    for r in rates:
        sub = sorted((p for p in points if float(p["rate"]) == r), key=lambda p: p["window_ms"])
        ws = [p["window_ms"] for p in sub]
        out.append((go.Scatter(x=ws, y=[p["ttft_ms_p95"] for p in sub], mode="lines+markers", name=f"TTFT · {r:g}/s",
                               line=dict(color=colour[r]), legend="legend",
                               hovertemplate=f"{r:g} req/s, window %{{x:g}} ms: TTFT P95 %{{y:,.1f}} ms"
                                             "<extra></extra>"), 1))
        out.append((go.Scatter(x=ws, y=[p["queue_ms_p95"] for p in sub], mode="lines+markers",
                               name=f"queue wait · {r:g}/s", line=dict(color=colour[r], dash="dash"), legend="legend",
                               hovertemplate=f"{r:g} req/s, window %{{x:g}} ms: queue wait P95 %{{y:,.1f}} ms"
                                             "<extra></extra>"), 1))
    return out


def _key_traces() -> list[tuple]:
    """The colour keys of rows 2-4, as (trace, row) (traces with a point: an empty trace has no legend entry)."""
    import plotly.graph_objects as go

    from workbench.lab.sched_timeline import DECODE, PREFILL, QUEUE, RUNNING

    out = []
    for name, color, row, kind in (("prefill tokens", PREFILL, 2, "bar"), ("decode tokens", DECODE, 2, "bar"),
                                   ("waiting (queue)", QUEUE, 3, "line"), ("running", RUNNING, 3, "line"),
                                   ("prefilling", PREFILL, 4, "square"), ("decoding", DECODE, 4, "square")):
        style = (dict(mode="lines", line=dict(color=color)) if kind == "line" else
                 dict(mode="markers", marker=dict(symbol="square", size=10, color=color)))
        out.append((go.Scatter(x=[None], y=[None], name=name, hoverinfo="skip", legend=f"legend{row}", **style), row))
    return out


def _point_traces(p: dict, f, cells: list, visible: bool) -> list[tuple]:
    """One point's traces, as (trace, row), on the time axis of its run (ms since its first step):
    its ring on the sweep, tokens per step (each bar as wide as the step took), requests waiting
    and running, and the batch's prefilling and decoding squares."""
    import plotly.graph_objects as go

    from workbench.lab.sched_timeline import DECODE, PREFILL, QUEUE, RUNNING

    vis = visible
    t0 = float(f["start"].iloc[0])
    dur = ((f["schedule_s"] + f["model_s"] + f["post_s"]).to_numpy(dtype=float) * 1e3)
    start = (f["start"].to_numpy(dtype=float) - t0) * 1e3
    mid = [round(float(a + d / 2), 2) for a, d in zip(start, dur)]
    at = [round(float(a), 2) for a in start]
    width = [round(float(d), 2) for d in dur]
    steps = f["step"].astype(int).tolist()
    out = [(go.Scatter(x=[p["window_ms"]], y=[p["ttft_ms_p95"]], mode="markers", showlegend=False, visible=vis,
                       marker=dict(size=20, color="rgba(0,0,0,0)", line=dict(width=3, color="#000")),
                       hovertemplate=_point_title(p) + "<extra>picked</extra>"), 1)]
    for col, color, name in (("prefill_tokens", PREFILL, "prefill tokens"), ("decode_tokens", DECODE, "decode tokens")):
        out.append((go.Bar(x=mid, y=f[col].astype(int).tolist(), width=width, marker_color=color, showlegend=False,
                           visible=vis, customdata=steps, name=name,
                           hovertemplate="step %{customdata} at %{x:,.1f} ms: %{y} " + name + "<extra></extra>"), 2))
    for col, color, name in (("waiting", QUEUE, "waiting"), ("running", RUNNING, "running")):
        out.append((go.Scatter(x=at, y=f[col].astype(int).tolist(), mode="lines", line=dict(color=color, shape="hv"),
                               showlegend=False, visible=vis, name=name,
                               hovertemplate="%{x:,.1f} ms: %{y} " + name + "<extra></extra>"), 3))
    for want, color, what in ((True, PREFILL, "prefill chunk of"), (False, DECODE, "decoding,")):
        xs, ys, toks = [], [], []
        for a, batch in zip(at, cells):
            for rid, tok, pre in batch:
                if bool(pre) == want:
                    xs.append(a)
                    ys.append(str(rid))
                    toks.append(tok)
        out.append((go.Scatter(x=xs, y=ys, customdata=toks, mode="markers", showlegend=False, visible=vis,
                               marker=dict(symbol="square", size=6, color=color),
                               hovertemplate="%{y} at %{x:,.1f} ms: " + what + " %{customdata} tokens<extra></extra>"),
                    4))
    return out


def _picker_axes(fig, windows: list, requests: list) -> None:
    """The picker's axes: rows 2-4 share the picked point's time axis; the sweep's ticks at the
    measured windows; the batch row's requests in order of appearance, top down."""
    for row in (3, 4):
        fig.update_xaxes(matches="x2", row=row, col=1)
    fig.update_xaxes(title_text="micro-batch window (ms)", tickvals=windows, row=1, col=1)
    fig.update_xaxes(title_text="ms since the point's first step", row=4, col=1)
    fig.update_yaxes(title_text="ms", rangemode="tozero", row=1, col=1)
    fig.update_yaxes(title_text="tokens", rangemode="tozero", row=2, col=1)
    fig.update_yaxes(title_text="requests", rangemode="tozero", row=3, col=1)
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=requests, autorange="reversed",
                     row=4, col=1)


def sweep_picker_figure(points: list[dict], title: str = "micro-batch window x arrival rate: pick a point"):
    """Every measured point of a ``window_ms`` x rate sweep in one plain plotly figure, and a
    dropdown (plotly's own, so it works offline: in a saved notebook and the HTML report) that
    picks which point's timeline is shown.  ``points``: one dict per replay with ``window_ms``,
    ``rate``, ``ttft_ms_p95``, ``queue_ms_p95``, ``mean_batch``, ``steps`` and ``steps_frame``
    (the engine's ``steps_frame()``; idle steps are dropped, :func:`busy_steps`).

    Rows: (1) the sweep itself, TTFT P95 (solid) and queue wait P95 (dashed) against the window,
    one colour per rate, the picked point ringed; then the picked point's run on one time axis
    (ms since its first step): (2) tokens per step, prefill and decode stacked, each bar as wide
    as the step took; (3) requests waiting and running after each step; (4) the batch, one
    square per request computed in a step (blue prefilling, orange decoding).  Every point's data
    is in the figure; the dropdown only switches which traces are visible."""
    from plotly.subplots import make_subplots

    from workbench.lab.sched_timeline import busy_steps, row_legends, step_cells
    from workbench.lab.viz import PALETTE

    if not points:
        raise ConfigError("sweep_picker_figure: no points")
    missing = [k for k in ("window_ms", "rate", "ttft_ms_p95", "queue_ms_p95", "mean_batch", "steps", "steps_frame")
               if k not in points[0]]
    if missing:
        raise ConfigError(f"sweep_picker_figure: each point needs {missing}")
    rates = sorted({float(p["rate"]) for p in points})
    colour = {r: PALETTE[i % len(PALETTE)] for i, r in enumerate(rates)}
    prepared = []
    requests: dict = {}
    for p in points:
        f = busy_steps(p["steps_frame"])
        cells = step_cells(f)
        for batch in cells:
            for rid, *_ in batch:
                requests.setdefault(rid, len(requests))
        prepared.append((p, f, cells))
    from workbench.lab.sched_timeline import requests_row_px

    req_px = requests_row_px(len(requests))
    fig = make_subplots(rows=4, cols=1, vertical_spacing=55 / (230 + 150 + 140 + req_px + 120),
                        row_heights=[230, 150, 140, req_px],
                        subplot_titles=("the sweep: P95 by window (picked point ringed)",
                                        "the picked point: tokens per step", "requests waiting and running",
                                        "the batch: requests computed in each step"))
    always: list[bool] = []                      # which traces every choice shows
    owner: list[int] = []                        # the point a trace belongs to (-1: none)

    def add(trace, row, point=-1):
        fig.add_trace(trace, row=row, col=1)
        always.append(point < 0)
        owner.append(point)

    for trace, row in _sweep_traces(points, rates, colour) + _key_traces():
        add(trace, row)
    for i, (p, f, cells) in enumerate(prepared):
        for trace, row in _point_traces(p, f, cells, visible=i == 0):
            add(trace, row, i)
    buttons = [{"label": _point_name(p), "method": "update",
                "args": [{"visible": [a or o == i for a, o in zip(always, owner)]},
                         {"title.text": f"{title}<br><sup>{_point_title(p)}</sup>"}]}
               for i, (p, _, _) in enumerate(prepared)]
    _picker_axes(fig, sorted({p["window_ms"] for p in points}), sorted(requests, key=requests.get))
    height = 230 + 150 + 140 + req_px + 120 + 170
    fig.update_layout(title=dict(text=f"{title}<br><sup>{_point_title(prepared[0][0])}</sup>", y=1, yref="container",
                                 yanchor="top", pad=dict(t=12)),
                      barmode="stack", bargap=0, height=height, margin=dict(l=70, r=20, t=150, b=60),
                      updatemenus=[{"type": "dropdown", "direction": "down", "active": 0, "showactive": True,
                                    "x": 0.15, "xanchor": "left", "y": 1, "yanchor": "bottom", "pad": {"b": 44},
                                    "buttons": buttons}])
    fig.add_annotation(text="<b>point shown:</b>", xref="paper", yref="paper", x=0, y=1, xanchor="left",
                       yanchor="bottom", yshift=52, showarrow=False, font=dict(size=13))
    row_legends(fig, rows=4)
    return fig


# ---- tables a learner can read ------------------------------------------------------------------
DASH = "—"
# column -> (header with its unit, format): "ms" one decimal, "int", "2" two decimals, "1" one decimal,
# "pct" a share shown in %, "yes" a boolean
TRACE_COLUMNS = {"ttft_ms_p50": ("TTFT P50 (ms)", "ms"), "ttft_ms_p95": ("TTFT P95 (ms)", "ms"),
                 "short_ttft_ms_p95": ("short prompts' TTFT P95 (ms)", "ms"),
                 "queue_ms_p50": ("queue wait P50 (ms)", "ms"), "queue_ms_p95": ("queue wait P95 (ms)", "ms"),
                 "itl_ms_p95": ("ITL P95 (ms)", "ms"), "itl_ms_max": ("longest stall, ITL max (ms)", "ms"),
                 "mean_batch": ("mean batch (sequences)", "2"), "steps": ("steps", "int"),
                 "tokens_per_s": ("output tokens/s", "1")}
LOAD_COLUMNS = {"requests": ("requests", "int"), "ok": ("served", "int"), "rejected": ("shed", "int"),
                "offered_qps": ("offered (req/s)", "1"), "goodput_qps": ("goodput (req/s)", "1"),
                "ttft_p50_ms": ("TTFT P50 (ms)", "ms"), "ttft_p95_ms": ("TTFT P95 (ms)", "ms"),
                "ttft_p99_ms": ("TTFT P99 (ms)", "ms")}
PREEMPTION_COLUMNS = {"mode": ("preemption mode", "text"), "request": ("request", "text"),
                      "priority": ("priority", "int"), "preemptions": ("preemptions", "int"),
                      "TTFT ms": ("TTFT (ms)", "ms"), "E2E ms": ("end to end (ms)", "ms")}


def fmt_cell(v, kind: str) -> str:
    """One value as a table shows it (see :func:`readable`): "—" for a missing one, never NaN."""
    import math
    import numbers

    if v is None or (isinstance(v, float) and math.isnan(v)):
        return DASH
    if kind == "yes" or isinstance(v, bool) or type(v).__name__ == "bool_":
        return "yes" if v else "no"
    if kind == "text" or not isinstance(v, numbers.Real):
        return str(v)
    v = float(v)
    if math.isnan(v):
        return DASH
    if kind == "int":
        return f"{v:,.0f}"
    if kind == "pct":
        return f"{100 * v:.1f} %"
    if kind == "2":
        return f"{v:,.2f}"
    return f"{v:,.1f}"                             # "ms", "1"


def readable(df, columns: dict, index: dict | None = None):
    """``df``'s ``columns`` (name -> (header, format), in that order; others dropped) as a table of
    text: headers with their unit, ms to one decimal, counts as integers, "—" where a value is
    missing.  ``index``: the index levels renamed (name -> header); ``True`` / ``False`` labels
    read "yes" / "no".  The numbers in ``df`` are untouched (save those, show this)."""
    import pandas as pd

    keep = [c for c in columns if c in df.columns]
    out = pd.DataFrame({columns[c][0]: [fmt_cell(v, columns[c][1]) for v in df[c].tolist()] for c in keep},
                       index=df.index)

    def label(v):
        if isinstance(v, (bool,)) or type(v).__name__ == "bool_":
            return "yes" if v else "no"
        if isinstance(v, float):
            return f"{v:g}"
        return v

    if isinstance(out.index, pd.MultiIndex):
        out.index = pd.MultiIndex.from_tuples([tuple(label(x) for x in t) for t in out.index],
                                              names=[(index or {}).get(n, n) for n in out.index.names])
    elif not isinstance(out.index, pd.RangeIndex):
        out.index = pd.Index([label(x) for x in out.index], name=(index or {}).get(out.index.name, out.index.name))
    return out


def metrics_table(metrics: dict):
    """The notebook's metrics as one readable column: floats with four significant digits (no
    2.243731 or 257.349746), booleans yes / no, text as it is; the saved values are untouched."""
    import numbers

    import pandas as pd

    def show(v):
        if isinstance(v, bool) or type(v).__name__ == "bool_":
            return "yes" if v else "no"
        if isinstance(v, numbers.Integral):
            return f"{v:,}"
        if isinstance(v, numbers.Real):
            return fmt_cell(v, "text") if v != v else f"{v:,.4g}" if abs(v) < 1e4 else f"{v:,.0f}"
        return str(v)

    return pd.DataFrame({"value": [show(v) for v in metrics.values()]}, index=pd.Index(list(metrics), name="metric"))
POINT_COLUMNS = {"window_ms": ("window (ms)", "1"), "rate": ("arrivals (req/s)", "1"),
                 "TTFT p50 ms": ("TTFT P50 (ms)", "ms"), "TTFT p95 ms": ("TTFT P95 (ms)", "ms"),
                 "queue p95 ms": ("queue wait P95 (ms)", "ms"), "ITL p95 ms": ("ITL P95 (ms)", "ms"),
                 "mean batch": ("mean batch (sequences)", "2"), "steps": ("steps", "int"),
                 "tokens/s": ("output tokens/s", "1")}
