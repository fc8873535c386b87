"""The scheduler timeline: a static plotly figure of an engine's steps (plotly imported inside).

:func:`scheduler_timeline` draws ``LLMEngine.steps_frame()`` per engine step: prefill vs decode
tokens as stacked bars, the step's time split (scheduler / model / after sampling), and which
requests were in the batch, each marked prefilling or decoding (with its token count).
:func:`row_legends` gives each row of a one-column subplot figure its own legend.
"""

from __future__ import annotations

import math

import numpy as np

from workbench.errors import ConfigError

TIMELINE_COLUMNS = ("step", "start", "schedule_s", "model_s", "post_s", "num_seqs", "prefill_tokens",
                    "decode_tokens", "request_ids")
ROW_PX = 16                 # the requests row: pixels per request, so that every request's name fits
TOKEN_TIME_PX = 430         # the two upper rows (tokens, time) together


def requests_row_px(n: int) -> int:
    """The height of the "requests in the batch" row for ``n`` requests shown: ``ROW_PX`` each
    (so plotly can label every one), at least 150 px and at most 640 px (past 40 requests
    plotly labels every second or third; the hover still names each)."""
    return int(min(640, max(150, ROW_PX * n)))


def legend_name(row: int) -> str:
    """The layout key of row ``row``'s legend: ``legend``, ``legend2``, ..."""
    return "legend" if row == 1 else f"legend{row}"


def row_legends(fig, rows: int, col: int = 1) -> None:
    """One horizontal legend per subplot row of a one-column ``make_subplots`` figure, on the
    line of the row's title and right-aligned (the titles move to the left), so that no legend
    takes width from the plots.  Traces pick theirs with ``legend=legend_name(row)``.  For static
    figures only: a FigureWidget (plotly 7.1) draws an empty plot for a figure with a second legend
    or a trace with a ``legend`` property."""
    titles = list(fig.layout.annotations)
    for row in range(1, rows + 1):
        top = fig.get_subplot(row, col).yaxis.domain[1]
        # traceorder "normal": plotly would list stacked bars top-down, right to left here
        fig.update_layout({legend_name(row): dict(orientation="h", x=1, xanchor="right", y=top, yanchor="bottom",
                                                  traceorder="normal", bgcolor="rgba(0,0,0,0)", itemwidth=30,
                                                  font=dict(size=11))})
        if row <= len(titles):
            titles[row - 1].update(x=0, xanchor="left", font=dict(size=13))


def scheduler_timeline(frame, x: str = "step", max_requests: int = 64, title: str = "Scheduler timeline"):
    """A static plotly figure of an engine's steps, from ``LLMEngine.steps_frame()`` (or any
    table with its columns).  Three rows sharing the x axis:

    1. tokens computed per step: prefill and decode as stacked bars (their heights add up to
       the frame's ``prefill_tokens`` / ``decode_tokens``);
    2. the step's time in ms, stacked: ``schedule_s`` (pure-Python scheduler), ``model_s``
       (swaps + forward + sampling) and ``post_s`` (detokenization, stop checks);
    3. batch composition: one marker per (step, request) for the requests computed in the step
       (the first ``max_requests`` requests to appear, by first step; the rest are counted in
       the title).  With the frame's ``request_tokens`` column (tokens each request computed in
       the step) the markers are split into a "prefilling" and a "decoding" trace, coloured as
       the token bars, with the token count in ``customdata`` and on hover; ``request_prefill``
       (per request: a prefill chunk?) says which, else a request computing more than one token
       counts as prefilling.  Rows without them (an older frame) keep one "in batch" trace.

    ``x="step"``: one bar per step; ``x="time"``: bars placed at the step's start (seconds from
    the first step) with the step's duration as their width, so idle gaps show.  Each row has
    its own legend above it; the totals (steps, tokens, the scheduler's share) are the title's
    subtitle; the figure grows with the number of requests shown (:func:`requests_row_px`).
    Needs no display: save it with ``write_html`` / ``to_json`` or show it in a notebook."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if x not in ("step", "time"):
        raise ConfigError(f"scheduler_timeline: x={x!r} must be 'step' or 'time'")
    if getattr(frame, "empty", False) and len(getattr(frame, "columns", ())) == 0:
        raise ConfigError("scheduler_timeline: the frame has no steps (run some requests through the engine first)")
    missing = [c for c in TIMELINE_COLUMNS if c not in getattr(frame, "columns", ())]
    if missing:
        raise ConfigError(f"scheduler_timeline: column(s) {missing} missing; pass LLMEngine.steps_frame() "
                          f"(got columns {list(getattr(frame, 'columns', []))})")
    if len(frame) == 0:
        raise ConfigError("scheduler_timeline: the frame has no steps (run some requests through the engine first)")
    if not (isinstance(max_requests, int) and max_requests >= 0):
        raise ConfigError(f"scheduler_timeline: max_requests={max_requests!r} must be an integer >= 0")
    f = frame.reset_index(drop=True)
    dur = (f["schedule_s"] + f["model_s"] + f["post_s"]).to_numpy(dtype=float)
    if x == "time" and len(f):
        t0 = float(f["start"].iloc[0])
        xs = (f["start"].to_numpy(dtype=float) - t0) + dur / 2
        width, x_title = dur, "seconds since the first step"
    else:
        xs, width, x_title = f["step"].to_numpy(), None, "engine step"
    steps = f["step"].tolist()
    ids = [tuple(r) for r in f["request_ids"]]
    order: dict = {}
    for batch in ids:
        for rid in batch:
            order.setdefault(rid, len(order))
    shown = {rid for rid, k in order.items() if k < max_requests}
    hidden = len(order) - len(shown)
    split = _request_split(f, ids)           # per step: ((tokens, prefill?), ...) per request, or None
    hover = []
    for s, n, b, sp in zip(steps, f["num_seqs"], ids, split):
        names = [str(r) if sp is None else f"{r} ({'P' if sp[i][1] else 'D'} {sp[i][0]})"
                 for i, r in enumerate(b[:8])]
        hover.append(f"step {s}<br>{n} seqs: " + ", ".join(names) + (" ..." if len(b) > 8 else ""))

    req_px = requests_row_px(len(shown))
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=45 / (TOKEN_TIME_PX + req_px + 90),
                        row_heights=[0.54 * TOKEN_TIME_PX, 0.46 * TOKEN_TIME_PX, req_px],
                        subplot_titles=("tokens per step", "time per step (ms)",
                                        "requests in the batch" + (f" (first {max_requests}; {hidden} more not "
                                                                   "shown)" if hidden else "")))
    bar = lambda name, y, color, row: go.Bar(x=xs, y=y, width=width, name=name, marker_color=color,  # noqa: E731
                                             legend=legend_name(row), hovertext=hover,
                                             hovertemplate="%{hovertext}<br>" + name + ": %{y}<extra></extra>")
    fig.add_trace(bar("prefill tokens", f["prefill_tokens"].tolist(), "#1f77b4", 1), row=1, col=1)
    fig.add_trace(bar("decode tokens", f["decode_tokens"].tolist(), "#ff7f0e", 1), row=1, col=1)
    for col, name, color in (("schedule_s", "scheduler", "#d62728"), ("model_s", "model", "#2ca02c"),
                             ("post_s", "after sampling", "#9467bd")):
        fig.add_trace(bar(name, (f[col].to_numpy(dtype=float) * 1e3).tolist(), color, 2), row=2, col=1)
    cells: dict[str, tuple[list, list, list]] = {"prefilling": ([], [], []), "decoding": ([], [], []),
                                                 "in batch": ([], [], [])}
    for xv, batch, sp in zip(xs, ids, split):
        for i, rid in enumerate(batch):
            if rid in shown:
                kind = "in batch" if sp is None else ("prefilling" if sp[i][1] else "decoding")
                px, py, pt = cells[kind]
                px.append(xv)
                py.append(str(rid))
                pt.append(None if sp is None else sp[i][0])
    kinds = (["prefilling", "decoding"] if "request_tokens" in f.columns else []) + (
        ["in batch"] if "request_tokens" not in f.columns or cells["in batch"][0] else [])
    for kind in kinds:
        px, py, pt = cells[kind]
        color, what = {"prefilling": ("#1f77b4", "prefill chunk of %{customdata} tokens"),
                       "decoding": ("#ff7f0e", "decoding (%{customdata} tokens)"),
                       "in batch": (None, "in the batch")}[kind]
        marker = dict(size=5 if kind == "in batch" else 6, symbol="square", **({"color": color} if color else {}))
        fig.add_trace(go.Scatter(x=px, y=py, mode="markers", name=kind, marker=marker, legend=legend_name(3),
                                 customdata=pt if kind != "in batch" else None,
                                 hovertemplate="%{y} at %{x}: " + what + "<extra></extra>"), row=3, col=1)
    fig.update_yaxes(categoryorder="array", categoryarray=sorted(shown, key=order.get), autorange="reversed",
                     row=3, col=1)
    fig.update_layout(barmode="stack", bargap=0.1 if x == "step" else 0, height=TOKEN_TIME_PX + req_px + 90 + 155,
                      margin=dict(l=70, r=20, t=105, b=50))
    fig.update_yaxes(title_text="tokens", row=1, col=1)
    fig.update_yaxes(title_text="ms", row=2, col=1)
    fig.update_xaxes(title_text=x_title, row=3, col=1)
    row_legends(fig, rows=3)
    total = dur.sum()
    share = f["schedule_s"].sum() / total if total > 0 else math.nan
    fig.update_layout(title=dict(text=title, subtitle=dict(
        text=f"{len(f)} steps, {int(f['prefill_tokens'].sum())} prefill + {int(f['decode_tokens'].sum())} decode "
             f"tokens; the scheduler took {share:.1%} of the step time")))
    return fig


def _request_split(f, ids: list[tuple]) -> list:
    """Per step: ``((tokens, is_prefill), ...)`` for its requests, from the frame's
    ``request_tokens`` (and ``request_prefill``) columns; None for a step without them (a frame
    from an older engine, or rows of one concatenated with such a frame)."""
    def seq(v):
        return tuple(v) if isinstance(v, (tuple, list, np.ndarray)) else None

    toks = list(f["request_tokens"]) if "request_tokens" in f.columns else [None] * len(ids)
    pre = list(f["request_prefill"]) if "request_prefill" in f.columns else [None] * len(ids)
    out = []
    for b, t, p in zip(ids, toks, pre):
        t, p = seq(t), seq(p)
        if t is None or len(t) != len(b):
            out.append(None)
            continue
        flags = p if p is not None and len(p) == len(b) else tuple(int(n) > 1 for n in t)
        out.append(tuple((int(n), bool(q)) for n, q in zip(t, flags)))
    return out
