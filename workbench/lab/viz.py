"""Plots and live views for the notebooks (plotly; ipywidgets + anywidget for live ones).

Everything here imports plotly / ipywidgets lazily, inside the functions, so ``import
workbench`` works on a machine with only the core dependencies.

* :class:`LatencyStreamView` - a live per-token latency chart that updates while
  ``llm.stream(...)`` yields, and records every token as a frame.  A saved FigureWidget's state
  is stale (it holds whatever the widget last synced), so notebooks and reports show
  :meth:`LatencyStreamView.replay_figure` (plain plotly: ▶ replays the stream at its own pace, the
  slider steps token by token, offline) or :meth:`LatencyStreamView.static_figure` instead.
* :func:`replay_at_end` - a replay that shows its last frame until ▶ is pressed.
* :func:`latency_histogram`, :func:`breakdown_bar`, :func:`comparison_bar` - static
  ``go.Figure`` s for reports.
* :func:`label_levels` - the rule that keeps labels at nearby x (P50 / P95 / P99) from
  overlapping; :func:`describe_hook_overhead` - the decode profile's hook cost, or "within noise".

A live view's outermost widget carries the CSS classes ``wb-live`` and ``wb-live-<name>``, so a
browser run (:mod:`workbench.lab.browser`) can find it in the page.
"""

from __future__ import annotations

import html
import time

import numpy as np


# colour-blind-safe (Okabe-Ito), and no red / green, which would read as bad / good
PALETTE = ("#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000")
LABEL_PX_PER_CHAR = 7.0     # a 12 px plotly label is about 7 px per character
MIN_PLOT_PX = 600           # the narrowest plot area we lay labels out for (a JupyterLab cell is wider)


def store_figure_state(fig, send: bool = False) -> None:
    """Store a FigureWidget's whole current state in its widget model, not only the change
    (the two traits sync, so assigning them sends the figure); ``send``: send it once more (at
    the end of a live run). Call it when a run ends, not at every redraw: it serialises the
    whole figure.

    A FigureWidget sends each update as a one-off delta, applied by the views that exist
    then; a view created later is drawn from the model's ``_widget_data`` /
    ``_widget_layout``, which plotly sets only at construction and display.  Seen in
    JupyterLab 4.6 on a loaded 2-core machine: the browser drew the output after the
    stream had ended and the chart came up empty (no trace, no title); with this it shows
    the run.  The same assignments as ``FigureWidget._repr_mimebundle_``; at the end the
    layout is sent again too, since the first message after a widget opens can be lost
    while the browser is still creating its model.  Every live view calls it when its run ends.
    """
    from copy import deepcopy

    if not (hasattr(fig, "_widget_data") and hasattr(fig, "_layout_obj")):
        return                          # a plotly without these internals: deltas only
    fig._widget_data = deepcopy(fig._data)
    fig._widget_layout = deepcopy(fig._layout_obj._props)
    if send:
        fig.send_state(["_widget_data", "_widget_layout"])


def _metrics(o):
    return getattr(o, "metrics", o)


def label_levels(xs, min_gap: float) -> list[int]:
    """A row (0, 1, 2 ...) for a label at each ``x`` so that two labels closer than ``min_gap``
    never share a row; each label takes the lowest row that is free at its x (greedy from the
    left, so labels far apart all stay on row 0). Returned in the order of ``xs``::

        label_levels([13.6, 19.1, 22.0], min_gap=2.0)   # [0, 0, 0]
        label_levels([13.6, 13.7, 13.9], min_gap=2.0)   # [0, 1, 2]
    """
    if min_gap < 0:
        raise ValueError(f"label_levels: min_gap must be >= 0, got {min_gap}")
    last: list[float] = []              # per row, the x of the rightmost label placed on it
    levels = [0] * len(xs)
    for i in sorted(range(len(xs)), key=lambda k: xs[k]):
        x = xs[i]
        row = next((r for r, lx in enumerate(last) if x - lx >= min_gap), len(last))
        if row == len(last):
            last.append(x)
        last[row] = x
        levels[i] = row
    return levels


def _label_gap(texts, span: float) -> float:
    """The x distance (data units) a label of the longest of ``texts`` covers on a plot
    ``MIN_PLOT_PX`` wide spanning ``span``, plus a little air."""
    chars = max((len(t) for t in texts), default=0)
    return (chars + 1) * LABEL_PX_PER_CHAR / MIN_PLOT_PX * span


def hook_overhead_within_noise(attrs, noise: float) -> bool:
    """True when the hooked step is not slower than the plain one by more than the noise floor
    ``noise`` (a fraction, e.g. :attr:`NoiseProbe.threshold`). A negative overhead is always
    within noise: hooks only add work, so a hooked step that ran faster measured the machine."""
    return attrs["hook_overhead_pct"] <= 100.0 * noise


def hook_overhead_text(attrs, noise: float) -> str:
    """Short: ``+18% for the hooks`` or ``hooks' cost within noise``."""
    if hook_overhead_within_noise(attrs, noise):
        return "hooks' cost within noise"
    return f"{attrs['hook_overhead_pct']:+.0f}% for the hooks"


def describe_hook_overhead(attrs, noise: float) -> str:
    """One line on what the profile's hooks cost (``attrs`` of
    :func:`workbench.bench.profile.profile_decode_step`), judged against the noise floor."""
    a = attrs
    steps = f"median of {a['steps']} steps each, {a['device']}, {a['dtype']}"
    head = f"plain step {a['plain_step_ms']:.3f} ms, hooked step {a['hooked_step_ms']:.3f} ms"
    pct = a["hook_overhead_pct"]
    if not hook_overhead_within_noise(a, noise):
        return f"{head}: the hooks add {a['hook_overhead_ms']:.3f} ms ({pct:+.0f}%) per step ({steps})"
    if pct < -100.0 * noise:
        why = (f"the hooked steps ran {-pct:.0f}% faster, which hooks cannot cause: this run was noisier "
               f"than the {noise:.0%} floor")
    else:
        why = f"a {pct:+.0f}% difference, inside the {noise:.0%} noise floor"
    return f"{head}: within noise ({why}): the hooks' cost is too small to measure here ({steps})"


class LatencyStreamView:
    """Inter-token latency (ms) vs token index, live, plus running TTFT / TPOT / tokens and the
    streamed text::

        view = LatencyStreamView()
        out = view.run(llm, "The list data type", SamplingParams(temperature=0, max_tokens=48))
        view.static_figure()          # a plain go.Figure of the same data, for reports

    The widget is redrawn at most ``max_hz`` times a second, inside ``fig.batch_update()``
    (one delta message per redraw; when the stream ends, the whole figure for views drawn later:
    see :func:`store_figure_state`).  Redrawing runs between two tokens, so its cost lands in the
    next token's gap; :attr:`update_seconds` says how much that was in total.
    Its widget has the CSS classes ``wb-live`` and ``wb-live-latency-stream``.
    """

    css_name = "latency-stream"

    def __init__(self, max_hz: float = 15.0, title: str = "Per-token latency (live)", height: int = 320,
                 record: bool = True) -> None:

        if not 0 < max_hz <= 60:
            raise ValueError(f"LatencyStreamView: max_hz must be in (0, 60], got {max_hz}")
        self.min_interval = 1.0 / max_hz
        self.title, self.height = title, height
        self.record = record
        self._build()
        self._reset()

    def _build(self) -> None:
        """The widgets (again after a run ended and replaced them: see :meth:`run`)."""
        import ipywidgets as widgets
        import plotly.graph_objects as go

        from workbench.lab.live_output import LiveOutput

        title, height = self.title, self.height
        self.live = LiveOutput()
        self.fig = go.FigureWidget(
            data=[go.Scatter(x=[], y=[], mode="lines+markers", name="inter-token latency",
                             hovertemplate="token %{x}: %{y:.2f} ms<br>%{text}<extra></extra>", text=[])],
            layout=go.Layout(title=title, height=height, margin=dict(l=50, r=20, t=50, b=40),
                             xaxis_title="token index", yaxis_title="ms since previous token",
                             yaxis_rangemode="tozero"))
        self.label = widgets.HTML(value="<b>waiting for the first token...</b>")
        self.text = widgets.HTML(value="")
        self.widget = widgets.VBox([self.label, self.fig, self.text])
        self.widget.add_class("wb-live")
        self.widget.add_class(f"wb-live-{self.css_name}")

    def _reset(self) -> None:
        self.prompt_text = ""
        self.pieces: list[str] = []       # released text per token ("" while held back)
        self.times: list[float] = []      # the engine's clock at each token
        self.arrival: float | None = None
        self.updates = 0
        self.update_seconds = 0.0
        self.output = None
        from workbench.lab.replay import Recorder

        self.recorder = Recorder(max_frames=10_000)   # thinned when the replay is drawn
        self.record_seconds = 0.0          # building and keeping the frames (between two tokens)
        self._record_every = 1
        self._rec_y: list[float] = []
        self._rec_text: list[str] = []

    # ---- display -----------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        if self.fig is None:
            self._build()
        return self.widget._repr_mimebundle_(**kwargs)

    def display(self) -> LatencyStreamView:
        """Show the live widget; :meth:`run` replaces it when the stream ends (see
        :class:`~workbench.lab.live_output.LiveOutput`: a saved notebook then holds no widget)."""
        if self.live.shown or self.fig is None:     # shown already, or a run ended and closed it
            self._build()
        self.live.show(self.widget, self.fig, self.label, self.text)
        return self

    # ---- data --------------------------------------------------------------------------------
    @property
    def ttft_ms(self) -> float | None:
        return (self.times[0] - self.arrival) * 1e3 if self.times else None

    @property
    def itl_ms(self) -> list[float]:
        t = self.times
        return [(b - a) * 1e3 for a, b in zip(t, t[1:])]

    @property
    def tpot_ms(self) -> float | None:
        n = len(self.times)
        return (self.times[-1] - self.times[0]) / (n - 1) * 1e3 if n > 1 else None

    def _stats_html(self, done: bool) -> str:
        ttft = f"{self.ttft_ms:.1f} ms" if self.ttft_ms is not None else "-"
        tpot = f"{self.tpot_ms:.2f} ms" if self.tpot_ms is not None else "-"
        state = "done" if done else "streaming"
        return (f"<b>{state}</b> &nbsp; tokens: <b>{len(self.times)}</b> &nbsp; TTFT: <b>{ttft}</b> &nbsp; "
                f"TPOT: <b>{tpot}</b> &nbsp; redraws: {self.updates} ({self.update_seconds * 1e3:.0f} ms)")

    def _redraw(self, done: bool) -> None:
        t0 = time.monotonic()
        self.updates += 1
        itl = self.itl_ms
        with self.fig.batch_update():
            tr = self.fig.data[0]
            tr.x = list(range(1, len(itl) + 1))
            tr.y = itl
            tr.text = [repr(p) for p in self.pieces[1:]]
        if done:                    # the whole figure once, not at every redraw (it lands in a token gap)
            store_figure_state(self.fig, send=True)
        self.label.value = self._stats_html(done)
        self.text.value = ("<pre style='white-space:pre-wrap;margin:0'>" + html.escape(self.prompt_text) +
                           "<b>" + html.escape("".join(self.pieces)) + "</b></pre>")
        self.update_seconds += time.monotonic() - t0

    def _record(self, done: bool) -> None:
        """A frame of the chart as it stands (every token, or every k-th of a long stream: at
        most ~240 frames), stamped with the token's time since arrival on the engine's clock.
        Runs between two tokens, like a redraw: its cost lands in the next gap, and is counted
        in :attr:`record_seconds`."""
        n = len(self.times)
        if not done and n % self._record_every:
            return
        t0 = time.monotonic()
        while len(self._rec_y) < n - 1:              # the new gaps since the last frame, appended
            k = len(self._rec_y) + 1
            self._rec_y.append((self.times[k] - self.times[k - 1]) * 1e3)
            self._rec_text.append(repr(self.pieces[k]))
        itl = self._rec_y
        data = [{"x": list(range(1, len(itl) + 1)), "y": list(itl), "text": list(self._rec_text)}]
        gap = f": gap {itl[-1]:.1f} ms" if itl else ": first token (TTFT)"
        self.recorder.add(data, label=f"token {n}{gap}", t_ms=(self.times[-1] - self.arrival) * 1e3)
        self.record_seconds += time.monotonic() - t0

    @property
    def record_us_per_token(self) -> float:
        return self.record_seconds / len(self.times) * 1e6 if self.times else 0.0

    def recording_text(self) -> str:
        """What recording the replay cost, per token and against the median gap."""
        itl = self.itl_ms
        med = float(np.median(itl)) if itl else float("nan")
        share = self.record_us_per_token / 1e3 / med if itl and med > 0 else float("nan")
        return (f"replay: {len(self.recorder.frames)} frames recorded in {self.record_seconds * 1e3:.2f} ms, "
                f"{self.record_us_per_token:.0f} µs per token ({share:.2%} of the median gap of {med:.2f} ms; "
                "it runs between two tokens, so it lands in the next gap, as the redraws do)")

    def run(self, llm, prompt, params=None, display: bool = True):
        """Stream one request into the view; returns its ``RequestOutput`` (text, ids, metrics)."""
        from workbench.engine.llm import RequestOutput

        self._reset()
        if self.fig is None:                       # the last run ended and closed its widgets
            self._build()
        max_tokens = getattr(params, "max_tokens", None) or 0
        self._record_every = max(1, max_tokens // 240)
        if display:
            self.display()
        out = RequestOutput(request_id="", prompt=None, prompt_token_ids=[])
        self.prompt_text = prompt if isinstance(prompt, str) else ""
        clock = getattr(getattr(llm, "engine", None), "clock", None) or time.monotonic
        self.arrival = clock()                     # on the engine's clock: its events' times are
        last = 0.0
        for ev in llm.stream(prompt, params, arrival_time=self.arrival, output=out):
            self.times.append(ev.time)
            self.pieces.append(ev.text if llm.tokenizer else f" {ev.token_id}")
            if self.record:
                self._record(ev.finished)
            now = time.monotonic()
            if ev.finished or now - last >= self.min_interval:
                self._redraw(ev.finished)
                last = time.monotonic()
        self._redraw(True)
        self.output = out
        if self.live.shown:      # the live widget's place: a line (the replay, shown next, has the run)
            self.live.end(note=f"The live view has ended: {len(self.times)} tokens, {self.updates} redraws. "
                               "Its replay (replay_figure()) plays the run back.")
            self.fig = None
        return out

    def replay_figure(self):
        """The run as a replay (:func:`workbench.lab.replay.replay_figure`): one frame per token,
        ▶ plays the stream at its recorded pace (or slower), the slider steps token by token with
        each token's time in ms.  Shows the end of the run until ▶ is pressed
        (:func:`replay_at_end`), so a saved notebook or a report shows the whole stream.  Plain
        plotly: it works without a kernel.  None when nothing was recorded."""
        import plotly.graph_objects as go

        from workbench.lab.replay import replay_figure

        frames = self.recorder.frames
        if not frames:
            return None
        itl = self.itl_ms
        top = max(itl) if itl else 1.0
        fig = go.Figure(go.Scatter(x=[], y=[], mode="lines+markers", name="inter-token latency", text=[],
                                   marker_color=PALETTE[0], line_color=PALETTE[0],
                                   hovertemplate="token %{x}: %{y:.2f} ms<br>%{text}<extra></extra>"))
        ttft = f"{self.ttft_ms:.1f}" if self.ttft_ms is not None else "-"
        span = (self.times[-1] - self.arrival) * 1e3 if self.times else 0.0
        fig.update_layout(title=f"Per-token latency, replayed: {len(self.times)} tokens in {span:,.1f} ms "
                                f"(TTFT {ttft} ms)",
                          xaxis={"title": "token index", "range": [0, max(len(itl), 1) + 1]},
                          yaxis={"title": "ms since previous token", "range": [0, top * 1.15]},
                          height=340, margin={"l": 60, "r": 30, "t": 50, "b": 40}, showlegend=False)
        fig = replay_figure(fig, frames, redraw=False, time_label="since arrival", note=self.recording_text())
        return replay_at_end(fig)

    def static_figure(self):
        """A plain ``go.Figure`` of the last run (safe to save; FigureWidget state is not)."""
        import plotly.graph_objects as go

        itl = self.itl_ms
        fig = go.Figure(go.Scatter(x=list(range(1, len(itl) + 1)), y=itl, mode="lines+markers",
                                   name="inter-token latency", text=[repr(p) for p in self.pieces[1:]],
                                   hovertemplate="token %{x}: %{y:.2f} ms<br>%{text}<extra></extra>"))
        if itl:      # the label sits in the right margin, where no data point is
            fig.add_hline(y=float(np.median(itl)), line_dash="dot",
                          annotation_text=f"median<br>{np.median(itl):.2f} ms", annotation_position="right")
        ttft = f"{self.ttft_ms:.1f}" if self.ttft_ms is not None else "-"
        tpot = f"{self.tpot_ms:.2f}" if self.tpot_ms is not None else "-"
        fig.update_layout(title=f"Per-token latency: {len(self.times)} tokens, TTFT {ttft} ms, TPOT {tpot} ms",
                          xaxis_title="token index", yaxis_title="ms since previous token",
                          yaxis_rangemode="tozero", height=340, margin={"l": 60, "r": 80, "t": 50, "b": 40})
        return fig


def replay_at_end(fig):
    """A replay (:func:`workbench.lab.replay.replay_figure`) that shows its last frame, the slider
    at its last step, until ▶ is pressed: a saved notebook or a report then shows the whole run,
    not its first frame.  ▶ still plays every frame from the first (plotly's play starts over when
    the current frame is the last).  Returns ``fig``."""
    frames = list(fig.frames or [])
    if not frames:
        return fig
    last = frames[-1]
    for trace, data in zip(fig.data, last.data or []):
        trace.update(data.to_plotly_json() if hasattr(data, "to_plotly_json") else data)
    if last.layout:
        fig.update_layout(last.layout.to_plotly_json() if hasattr(last.layout, "to_plotly_json") else last.layout)
    if fig.layout.sliders:
        fig.layout.sliders[0].active = len(frames) - 1
    return fig


PERCENTILE_DASH = ((50, "solid"), (95, "dash"), (99, "dot"))


def latency_histogram(outputs, bins: int = 40):
    """Inter-token latencies (ms) over all ``outputs`` (RequestOutputs or RequestMetrics) as a
    histogram with P50 / P95 / P99 marked, and below it each request's TTFT on its own x axis
    (a TTFT is a prefill, often many times an inter-token gap: on one axis it would squash the
    histogram). Percentile labels that would overlap go on separate rows (:func:`label_levels`)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    ms = [_metrics(o) for o in outputs]
    itl = np.array([g * 1e3 for m in ms for g in m.itl])
    ttft = [m.ttft * 1e3 for m in ms if m.ttft is not None]
    panels = [p for p, vals in (("itl", itl.size), ("ttft", len(ttft))) if vals] or ["itl"]
    heights = {"itl": 0.74, "ttft": 0.26}
    fig = make_subplots(rows=len(panels), cols=1, row_heights=[heights[p] for p in panels],
                        vertical_spacing=0.22 if len(panels) > 1 else 0.0)
    top_rows = 0
    if itl.size:
        fig.add_trace(go.Histogram(x=itl, nbinsx=bins, name="inter-token latency", showlegend=False,
                                   marker_color=PALETTE[0],
                                   hovertemplate="%{x} ms: %{y} gaps<extra></extra>"), row=1, col=1)
        qs = [(q, dash, float(np.percentile(itl, q))) for q, dash in PERCENTILE_DASH]
        texts = [f"P{q} {v:.2f} ms" for q, _, v in qs]
        span = float(itl.max() - itl.min()) or 1.0
        levels = label_levels([v for _, _, v in qs], _label_gap(texts, span))
        for (_, dash, v), text, level in zip(qs, texts, levels):
            fig.add_vline(x=v, line_dash=dash, line_color="#333", line_width=1.5, row=1, col=1)
            fig.add_annotation(x=v, xref="x", y=1, yref="y domain", yanchor="bottom", yshift=2 + 17 * level,
                               text=text, showarrow=False, font_size=12, bgcolor="rgba(255,255,255,0.85)")
        top_rows = max(levels) + 1
        fig.update_xaxes(title_text="inter-token latency (ms): the gap between two consecutive tokens", row=1, col=1)
        fig.update_yaxes(title_text="gaps", row=1, col=1)
    if ttft:
        row = panels.index("ttft") + 1
        fig.add_trace(go.Box(x=ttft, name="TTFT", boxpoints="all", jitter=0.4, pointpos=0, orientation="h",
                             marker={"color": PALETTE[1], "size": 9}, line_color=PALETTE[1], fillcolor="rgba(0,0,0,0)",
                             showlegend=False, text=[f"request {i}" for i in range(len(ttft))],
                             hovertemplate="%{text}: TTFT %{x:.1f} ms<extra></extra>"), row=row, col=1)
        fig.update_xaxes(title_text=f"time to first token (ms), one point per request (median {np.median(ttft):.1f} "
                                    "ms): its own axis, not the one above", row=row, col=1)
        fig.update_yaxes(showticklabels=False, row=row, col=1)
    fig.update_layout(title=f"Latency distribution: {itl.size} inter-token gaps, {len(ttft)} requests",
                      bargap=0.05, height=300 + 150 * (len(panels) - 1) + 17 * top_rows,
                      # r: half a label, for a P99 at the edge
                      margin={"l": 60, "r": 50, "t": 70 + 17 * top_rows, "b": 50})
    return fig


def breakdown_bar(profile_df, title: str | None = None, noise: float | None = None):
    """Horizontal bars of ms per decode step per component (from
    :func:`workbench.bench.profile.profile_decode_step`), labelled with the share of the step.
    The default subtitle gives both step times and the hooks' cost, or "within noise" when the
    difference is inside ``noise`` (the machine's noise floor, a fraction; by default the last
    noise probe's, else 5 %)."""
    import plotly.graph_objects as go

    df = profile_df
    a = df.attrs
    fig = go.Figure(go.Bar(y=list(df.index), x=df["ms"], orientation="h", marker_color=PALETTE[0],
                           text=[f"{s:.1%}" for s in df["share"]], textposition="auto",
                           hovertemplate="%{y}: %{x:.3f} ms/step (%{text})<extra></extra>"))
    subtitle = None
    if title is None:
        title = "Decode step breakdown (hooked)"
        if "plain_step_ms" in a:
            if noise is None:
                from workbench.measure.probe import MIN_THRESHOLD, last_probe
                probe = last_probe()
                noise = probe.threshold if probe is not None else MIN_THRESHOLD
            subtitle = (f"step {a['hooked_step_ms']:.2f} ms with hooks, {a['plain_step_ms']:.2f} ms without "
                        f"({hook_overhead_text(a, noise)})")
    fig.update_layout(title={"text": title, "subtitle": {"text": subtitle} if subtitle else None},
                      xaxis_title="ms per step (median)", yaxis_autorange="reversed",
                      height=100 + 36 * len(df), margin={"l": 90, "r": 20, "t": 70 if subtitle else 50, "b": 40})
    return fig


def comparison_bar(df, title: str = "Comparison", labels: dict | None = None):
    """One small bar chart per column of ``df`` (so columns may have different units), one
    bar per row (index = the things compared, for example engines). ``labels``: a panel title
    per column (say the unit and which way is better); by default the column's name."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cols = [c for c in df.columns if np.issubdtype(np.asarray(df[c]).dtype, np.number)]
    if not cols:
        raise ValueError("comparison_bar: df has no numeric columns")
    labels = labels or {}
    fig = make_subplots(rows=1, cols=len(cols), subplot_titles=[str(labels.get(c, c)) for c in cols])
    names = [str(i) for i in df.index]
    for j, c in enumerate(cols, 1):
        vals = [float(v) for v in df[c]]
        fig.add_trace(go.Bar(x=names, y=vals, text=[f"{v:.3g}" for v in vals], textposition="auto",
                             marker_color=[PALETTE[k % len(PALETTE)] for k in range(len(names))],
                             showlegend=False, hovertemplate="%{x}: %{y:.4g}<extra></extra>"), row=1, col=j)
    fig.update_layout(title=title, height=360, margin={"l": 50, "r": 20, "t": 80, "b": 40})
    return fig
