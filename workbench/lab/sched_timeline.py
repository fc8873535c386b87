"""The scheduler timeline: plotly figures of an engine's steps (plotly imported inside).

:func:`scheduler_timeline` draws ``LLMEngine.steps_frame()`` per engine step: prefill vs decode
tokens as stacked bars, the step's time split (scheduler / model / after sampling), and which
requests were in the batch, each marked prefilling or decoding (with its token count).
:func:`scheduler_replay` plays the same records back step by step (play / pause / speeds and a
scrubber in ms, :mod:`workbench.lab.replay`): the tokens and the queue drawn up to the step shown,
the batch of that step over the whole run drawn faintly, preemptions marked; the engine records
every step anyway, so the replay costs the measured run nothing (its frames are built after it).
:func:`row_legends` gives each row of a one-column subplot figure its own legend;
:func:`tidy_replay` makes room for them above a replay's buttons.
"""

from __future__ import annotations

import math
import time

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

    _check_timeline_args(frame, x, max_requests)
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
    _batch_markers(fig, xs, ids, split, shown, per_request="request_tokens" in f.columns)
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


def _check_timeline_args(frame, x: str, max_requests) -> None:
    """:func:`scheduler_timeline`'s refusals: an ``x`` other than step / time, a frame without steps
    or without the timeline's columns, a ``max_requests`` that is not an integer >= 0."""
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


def _batch_markers(fig, xs, ids: list[tuple], split: list, shown: set, per_request: bool) -> None:
    """The timeline's third row: a marker per (step, shown request), as "prefilling" and "decoding"
    traces with each request's tokens when the frame has them (``per_request``), else (and for
    steps without them) one "in batch" trace."""
    import plotly.graph_objects as go

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
    kinds = (["prefilling", "decoding"] if per_request else []) + (
        ["in batch"] if not per_request or cells["in batch"][0] else [])
    for kind in kinds:
        px, py, pt = cells[kind]
        color, what = {"prefilling": ("#1f77b4", "prefill chunk of %{customdata} tokens"),
                       "decoding": ("#ff7f0e", "decoding (%{customdata} tokens)"),
                       "in batch": (None, "in the batch")}[kind]
        marker = dict(size=5 if kind == "in batch" else 6, symbol="square", **({"color": color} if color else {}))
        fig.add_trace(go.Scatter(x=px, y=py, mode="markers", name=kind, marker=marker, legend=legend_name(3),
                                 customdata=pt if kind != "in batch" else None,
                                 hovertemplate="%{y} at %{x}: " + what + "<extra></extra>"), row=3, col=1)


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


# ---- the scheduler timeline as a replay --------------------------------------------------------
PREFILL, DECODE = "#0072B2", "#E69F00"          # Okabe-Ito blue / orange: prefilling, decoding
QUEUE, RUNNING, SWAPPED, PREEMPT = "#CC79A7", "#009E73", "#56B4E9", "#D55E00"
FAINT = 0.22                                     # the opacity of the whole run drawn behind the replay
REPLAY_FRAMES = 60


def busy_steps(frame):
    """:func:`workbench.bench.sched_experiments.busy_steps`: the steps that computed something or
    changed the queue (a micro-batch window spins the engine through many empty ones)."""
    from workbench.bench.sched_experiments import busy_steps as busy

    return busy(frame)


def _check_steps(frame, who: str) -> None:
    missing = [c for c in TIMELINE_COLUMNS if c not in getattr(frame, "columns", ())]
    if missing:
        raise ConfigError(f"{who}: column(s) {missing} missing; pass LLMEngine.steps_frame() "
                          f"(got columns {list(getattr(frame, 'columns', []))})")
    if len(frame) == 0:
        raise ConfigError(f"{who}: the frame has no steps (run some requests through the engine first)")


def step_cells(f) -> list[list[tuple]]:
    """Per step of ``f``: ``(request, tokens, prefilling?)`` for each request in its batch (tokens
    None and prefilling None without the frame's per-request columns)."""
    ids = [tuple(r) for r in f["request_ids"]]
    split = _request_split(f, ids)
    return [[(rid, None if sp is None else sp[i][0], None if sp is None else sp[i][1]) for i, rid in enumerate(b)]
            for b, sp in zip(ids, split)]


def step_label(row, cells, preempted_so_far: int) -> str:
    """What the replay's slider says at a step: the batch, the queue, preemptions so far."""
    p = sum(1 for _, _, pre in cells if pre)
    d = sum(1 for _, _, pre in cells if pre is False)
    text = (f"step {int(row['step'])}: {len(cells)} in the batch ({p} prefilling, {d} decoding), "
            f"{int(row['waiting'])} waiting")
    if preempted_so_far:
        text += f", {preempted_so_far} preempted so far"
    return text


def scheduler_replay(frame, title: str = "Scheduler replay", max_frames: int = REPLAY_FRAMES,
                     max_requests: int = 64):
    """An engine's steps (``LLMEngine.steps_frame()``) as a replay: one frame per step (at most
    ``max_frames``, evenly spaced), each stamped with the step's start in ms, with play / pause /
    speed and a scrubber (:func:`workbench.lab.replay.replay_figure`).  Three rows on the step
    axis, each with its own legend:

    1. tokens per step: prefill and decode, stacked, drawn up to the step shown;
    2. the queue: requests waiting, running and swapped out after each step, and a mark at each
       step that preempted (hover: how many), up to the step shown;
    3. the batch: one square per request computed in the step shown (blue prefilling, orange
       decoding, hover: its tokens), over the whole run drawn faintly, so a learner sees which
       requests share the step and where in the run it is.

    Each frame's title says the step: its batch, the queue and the preemptions so far.  Steps
    that computed nothing are left out, unless the queue changed (:func:`busy_steps`).  The
    figure is plain plotly (no kernel needed)."""
    from plotly.subplots import make_subplots

    from workbench.lab.replay import replay_figure

    _check_steps(frame, "scheduler_replay")
    f = busy_steps(frame)
    if len(f) == 0:
        raise ConfigError("scheduler_replay: no step computed anything")
    cells = step_cells(f)
    order: dict = {}
    for batch in cells:
        for rid, *_ in batch:
            order.setdefault(rid, len(order))
    shown = [rid for rid, k in sorted(order.items(), key=lambda kv: kv[1]) if k < max_requests]
    keep = set(shown)
    steps = [int(s) for s in f["step"]]
    n = len(f)
    cols = {c: (f[c].astype(int).tolist() if c in f.columns else [0] * n)
            for c in ("prefill_tokens", "decode_tokens", "waiting", "running", "swapped", "preempted")}
    has_swap = any(cols["swapped"])
    req_px = requests_row_px(len(shown))
    fig = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=50 / (330 + req_px + 90),
                        row_heights=[170, 160, req_px],
                        subplot_titles=("tokens per step", "the queue after each step",
                                        "the batch of the step shown (faint: the whole run)"))
    lines = [("waiting", "waiting (queue)", QUEUE), ("running", "running", RUNNING)]
    if has_swap:
        lines.append(("swapped", "swapped out", SWAPPED))
    _replay_animated_traces(fig, steps, cols, lines)
    _replay_whole_run_traces(fig, steps, cols, lines, cells, keep)
    ymax = max(max(a + b for a, b in zip(cols["prefill_tokens"], cols["decode_tokens"])), 1)
    qmax = max(max(cols["waiting"] + cols["running"] + cols["swapped"]), 1)
    fig.update_yaxes(title_text="tokens", range=[0, ymax * 1.08], row=1, col=1)
    fig.update_yaxes(title_text="requests", range=[0, qmax * 1.15], row=2, col=1)
    fig.update_yaxes(type="category", categoryorder="array", categoryarray=shown, autorange="reversed", row=3, col=1)
    fig.update_xaxes(range=[steps[0] - 0.5, steps[-1] + 0.5], row=3, col=1)
    fig.update_xaxes(title_text="engine step", row=3, col=1)
    fig.update_layout(barmode="overlay", bargap=0.1, height=330 + req_px + 90 + 90, margin=dict(l=70, r=20, t=60, b=50))
    row_legends(fig, rows=3)
    # frames: one per step
    busy = (f["schedule_s"] + f["model_s"] + f["post_s"]).sum()
    share = f"; the scheduler took {f['schedule_s'].sum() / busy:.1%} of the step time" if busy > 0 else ""
    built = time.monotonic()
    rec = _replay_frames(f, cells, steps, cols, lines, keep, title)
    fig = replay_figure(fig, rec.frames, max_frames=max_frames, redraw=True, time_label="t",
                        note=f"{n} steps, {sum(cols['prefill_tokens']):,} prefill + {sum(cols['decode_tokens']):,} "
                             f"decode tokens{share}. The engine records every step anyway (StepRecord); these frames "
                             f"were built from the records after the run, in {(time.monotonic() - built) * 1e3:.1f} ms")
    return tidy_replay(fig)


def _replay_animated_traces(fig, steps: list[int], cols: dict, lines: list[tuple]) -> None:
    """The replay's traces that every frame gives new values, in the frames' order: the prefill and
    decode bars, the queue's lines, the preemption marks, the batch's prefilling and decoding squares;
    then row 3's colour key."""
    import plotly.graph_objects as go

    fig.add_trace(go.Bar(x=steps, y=[], name="prefill tokens", marker_color=PREFILL, legend="legend",
                         hovertemplate="step %{x}: %{y} prefill tokens<extra></extra>"), row=1, col=1)
    # bars overlaid (the faint whole run sits under the played one): decode bars start on top of the prefill ones
    fig.add_trace(go.Bar(x=steps, y=[], base=cols["prefill_tokens"], name="decode tokens", marker_color=DECODE,
                         legend="legend", hovertemplate="step %{x}: %{y} decode tokens<extra></extra>"), row=1, col=1)
    for _, name, color in lines:
        fig.add_trace(go.Scatter(x=steps, y=[], name=name, mode="lines", line=dict(color=color, shape="hv"),
                                 legend="legend2", hovertemplate=f"step %{{x}}: %{{y}} {name}<extra></extra>"),
                      row=2, col=1)
    fig.add_trace(go.Scatter(x=[], y=[], name="preempted", mode="markers", legend="legend2",
                             marker=dict(symbol="x", size=11, color=PREEMPT), customdata=[],
                             hovertemplate="step %{x}: %{customdata} preempted<extra></extra>"), row=2, col=1)
    for kind, color in (("prefilling", PREFILL), ("decoding", DECODE)):
        fig.add_trace(go.Scatter(x=[], y=[], name=kind, mode="markers", showlegend=False, customdata=[],
                                 marker=dict(symbol="square", size=10, color=color, line=dict(width=1, color="#000")),
                                 hovertemplate="%{y}: " + ("prefill chunk of" if kind == "prefilling" else "decoding,")
                                               + " %{customdata} tokens<extra></extra>"), row=3, col=1)
    # the colour key of row 3 (a trace with no point has no legend entry: the animated ones are often empty)
    for kind, color in (("prefilling", PREFILL), ("decoding", DECODE)):
        fig.add_trace(go.Scatter(x=[None], y=[None], name=kind, mode="markers", legend="legend3", hoverinfo="skip",
                                 marker=dict(symbol="square", size=10, color=color, line=dict(width=1, color="#000"))),
                      row=3, col=1)


def _replay_whole_run_traces(fig, steps: list[int], cols: dict, lines: list[tuple], cells: list, keep: set) -> None:
    """The whole run, faint and fixed behind the replay (not in the frames): the tokens, the queue and
    the batches of the requests shown."""
    import plotly.graph_objects as go

    fig.add_trace(go.Bar(x=steps, y=cols["prefill_tokens"], marker_color=PREFILL, opacity=FAINT, showlegend=False,
                         hoverinfo="skip"), row=1, col=1)
    fig.add_trace(go.Bar(x=steps, y=cols["decode_tokens"], base=cols["prefill_tokens"], marker_color=DECODE,
                         opacity=FAINT, showlegend=False, hoverinfo="skip"), row=1, col=1)
    for key, _, color in lines:
        fig.add_trace(go.Scatter(x=steps, y=cols[key], mode="lines", line=dict(color=color, shape="hv"),
                                 opacity=FAINT, showlegend=False, hoverinfo="skip"), row=2, col=1)
    for _, color, want in (("prefilling", PREFILL, True), ("decoding", DECODE, False)):
        xs, ys = [], []
        for s, batch in zip(steps, cells):
            for rid, _, pre in batch:
                if rid in keep and bool(pre) == want:
                    xs.append(s)
                    ys.append(str(rid))
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", showlegend=False, hoverinfo="skip", opacity=FAINT,
                                 marker=dict(symbol="square", size=6, color=color)), row=3, col=1)


def _replay_frames(f, cells: list, steps: list[int], cols: dict, lines: list[tuple], keep: set, title: str):
    """A :class:`~workbench.lab.replay.Recorder` with one frame per step: the animated traces' values
    up to the step (:func:`_replay_animated_traces`' order), its label (:func:`step_label`) in the
    title, a dotted line at the step, stamped with the step's start in ms."""
    from workbench.lab.replay import Recorder

    t0 = float(f["start"].iloc[0])
    rec = Recorder(max_frames=10_000)
    pre_so_far = 0
    pre_x: list = []
    pre_y: list = []
    pre_n: list = []
    for i, (row, batch) in enumerate(zip(f.to_dict("records"), cells)):
        if cols["preempted"][i]:
            pre_so_far += cols["preempted"][i]
            pre_x.append(steps[i])
            pre_y.append(cols["running"][i])
            pre_n.append(cols["preempted"][i])
        # a frame's trace without "type" is drawn as a scatter: the bars say theirs
        data = [{"type": "bar", "y": cols["prefill_tokens"][: i + 1]},
                {"type": "bar", "y": cols["decode_tokens"][: i + 1]}]
        data += [{"y": cols[key][: i + 1]} for key, *_ in lines]
        data.append({"x": list(pre_x), "y": list(pre_y), "customdata": list(pre_n)})
        for want in (True, False):
            sel = [(rid, tok) for rid, tok, pre in batch if rid in keep and bool(pre) == want]
            data.append({"x": [steps[i]] * len(sel), "y": [str(r) for r, _ in sel],
                         "customdata": [tok for _, tok in sel]})
        label = step_label(row, batch, pre_so_far)
        rec.add(data, label=label, t_ms=(float(row["start"]) - t0) * 1e3,
                layout={"title": {"text": f"{title}<br><sup>{label}</sup>"},
                        "shapes": [dict(type="line", xref="x", yref="paper", x0=steps[i], x1=steps[i], y0=0, y1=1,
                                        line=dict(color="rgba(0,0,0,0.35)", width=1, dash="dot"))]})
    return rec


def tidy_replay(fig, lift_px: int = 26):
    """A replay figure (:func:`workbench.lab.replay.replay_figure`) whose first row has a title
    and a legend of its own: lift the play / speed buttons ``lift_px`` above them, and hide the
    slider's step labels (sixty of them overlap; the step shown is named above the slider)."""
    for menu in fig.layout.updatemenus:
        menu.pad = dict(menu.pad.to_plotly_json() if menu.pad else {}, b=(menu.pad.b or 0) + lift_px)
    fig.update_layout(margin_t=fig.layout.margin.t + lift_px, height=fig.layout.height + lift_px,
                      title=dict(y=1, yref="container", yanchor="top", pad=dict(t=14)))
    slider = fig.layout.sliders[0]
    slider.font = dict(size=1, color="rgba(0,0,0,0)")
    slider.currentvalue.font = dict(size=13, color="#222")
    return fig
