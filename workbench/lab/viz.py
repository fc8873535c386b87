"""Plots and live views for the notebooks (plotly; ipywidgets + anywidget for live ones).

Everything here imports plotly / ipywidgets lazily, inside the functions, so ``import
workbench`` works on a machine with only the core dependencies.

* :class:`LatencyStreamView` - a live per-token latency chart that updates while
  ``llm.stream(...)`` yields.  A saved FigureWidget's state is stale (it holds whatever the
  widget last synced), so reports use :meth:`LatencyStreamView.static_figure` instead.
* :func:`latency_histogram`, :func:`breakdown_bar`, :func:`comparison_bar` - static
  ``go.Figure`` s for reports.
"""

from __future__ import annotations

import html
import time

import numpy as np


def _metrics(o):
    return getattr(o, "metrics", o)


class LatencyStreamView:
    """Inter-token latency (ms) vs token index, live, plus running TTFT / TPOT / tokens and the
    streamed text::

        view = LatencyStreamView()
        out = view.run(llm, "The list data type", SamplingParams(temperature=0, max_tokens=48))
        view.static_figure()          # a plain go.Figure of the same data, for reports

    The widget is redrawn at most ``max_hz`` times a second, inside ``fig.batch_update()``
    (one message per redraw).  Redrawing runs between two tokens, so its cost lands in the
    next token's gap; :attr:`update_seconds` says how much that was in total.
    """

    def __init__(self, max_hz: float = 15.0, title: str = "Per-token latency (live)", height: int = 320) -> None:
        import ipywidgets as widgets
        import plotly.graph_objects as go

        if not 0 < max_hz <= 60:
            raise ValueError(f"LatencyStreamView: max_hz must be in (0, 60], got {max_hz}")
        self.min_interval = 1.0 / max_hz
        self.title = title
        self.fig = go.FigureWidget(
            data=[go.Scatter(x=[], y=[], mode="lines+markers", name="inter-token latency",
                             hovertemplate="token %{x}: %{y:.2f} ms<br>%{text}<extra></extra>", text=[])],
            layout=go.Layout(title=title, height=height, margin=dict(l=50, r=20, t=50, b=40),
                             xaxis_title="token index", yaxis_title="ms since previous token",
                             yaxis_rangemode="tozero"))
        self.label = widgets.HTML(value="<b>waiting for the first token...</b>")
        self.text = widgets.HTML(value="")
        self.widget = widgets.VBox([self.label, self.fig, self.text])
        self._reset()

    def _reset(self) -> None:
        self.prompt_text = ""
        self.pieces: list[str] = []       # released text per token ("" while held back)
        self.times: list[float] = []      # perf_counter() of each token
        self.arrival: float | None = None
        self.updates = 0
        self.update_seconds = 0.0
        self.output = None

    # ---- display -----------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def display(self) -> "LatencyStreamView":
        from IPython.display import display
        display(self.widget)
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
        t0 = time.perf_counter()
        self.updates += 1
        itl = self.itl_ms
        with self.fig.batch_update():
            tr = self.fig.data[0]
            tr.x = list(range(1, len(itl) + 1))
            tr.y = itl
            tr.text = [repr(p) for p in self.pieces[1:]]
        self.label.value = self._stats_html(done)
        self.text.value = ("<pre style='white-space:pre-wrap;margin:0'>" + html.escape(self.prompt_text) +
                           "<b>" + html.escape("".join(self.pieces)) + "</b></pre>")
        self.update_seconds += time.perf_counter() - t0

    def run(self, llm, prompt, params=None, display: bool = True):
        """Stream one request into the view; returns its ``RequestOutput`` (text, ids, metrics)."""
        from workbench.engine.llm import RequestOutput

        self._reset()
        if display:
            self.display()
        out = RequestOutput(request_id="", prompt=None, prompt_token_ids=[])
        self.prompt_text = prompt if isinstance(prompt, str) else ""
        self.arrival = time.perf_counter()
        last = 0.0
        for ev in llm.stream(prompt, params, arrival_time=self.arrival, output=out):
            self.times.append(ev.time)
            self.pieces.append(ev.text if llm.tokenizer else f" {ev.token_id}")
            now = time.perf_counter()
            if ev.finished or now - last >= self.min_interval:
                self._redraw(ev.finished)
                last = time.perf_counter()
        self._redraw(True)
        self.output = out
        return out

    def static_figure(self):
        """A plain ``go.Figure`` of the last run (safe to save; FigureWidget state is not)."""
        import plotly.graph_objects as go

        itl = self.itl_ms
        fig = go.Figure(go.Scatter(x=list(range(1, len(itl) + 1)), y=itl, mode="lines+markers",
                                   name="inter-token latency", text=[repr(p) for p in self.pieces[1:]],
                                   hovertemplate="token %{x}: %{y:.2f} ms<br>%{text}<extra></extra>"))
        if itl:
            fig.add_hline(y=float(np.median(itl)), line_dash="dot",
                          annotation_text=f"median {np.median(itl):.2f} ms", annotation_position="top left")
        ttft = f"{self.ttft_ms:.1f}" if self.ttft_ms is not None else "-"
        tpot = f"{self.tpot_ms:.2f}" if self.tpot_ms is not None else "-"
        fig.update_layout(title=f"Per-token latency: {len(self.times)} tokens, TTFT {ttft} ms, TPOT {tpot} ms",
                          xaxis_title="token index", yaxis_title="ms since previous token",
                          yaxis_rangemode="tozero", height=340, margin=dict(l=50, r=20, t=50, b=40))
        return fig


def latency_histogram(outputs, bins: int = 40):
    """Histogram of inter-token latencies (ms) over all ``outputs`` (RequestOutputs or
    RequestMetrics), with P50 / P95 / P99 marked; TTFTs as a rug of markers above it."""
    import plotly.graph_objects as go

    ms = [_metrics(o) for o in outputs]
    itl = np.array([g * 1e3 for m in ms for g in m.itl])
    ttft = [m.ttft * 1e3 for m in ms if m.ttft is not None]
    fig = go.Figure()
    if itl.size:
        fig.add_trace(go.Histogram(x=itl, nbinsx=bins, name="inter-token latency"))
        for q, dash in ((50, "solid"), (95, "dash"), (99, "dot")):
            v = float(np.percentile(itl, q))
            fig.add_vline(x=v, line_dash=dash, annotation_text=f"P{q} {v:.2f}", annotation_position="top")
    if ttft:
        fig.add_trace(go.Scatter(x=ttft, y=[0] * len(ttft), mode="markers", name="TTFT (one per request)",
                                 marker=dict(symbol="line-ns-open", size=14), yaxis="y2"))
        fig.update_layout(yaxis2=dict(overlaying="y", visible=False, range=[-1, 10]))
    fig.update_layout(title=f"Latency distribution: {itl.size} inter-token gaps, {len(ttft)} requests",
                      xaxis_title="ms", yaxis_title="count", bargap=0.05, height=360)
    return fig


def breakdown_bar(profile_df, title: str | None = None):
    """Horizontal bars of ms per decode step per component (from
    :func:`workbench.bench.profile.profile_decode_step`), labelled with the share of the step."""
    import plotly.graph_objects as go

    df = profile_df
    a = df.attrs
    fig = go.Figure(go.Bar(y=list(df.index), x=df["ms"], orientation="h",
                           text=[f"{s:.1%}" for s in df["share"]], textposition="auto",
                           hovertemplate="%{y}: %{x:.3f} ms/step (%{text})<extra></extra>"))
    if title is None:
        title = "Decode step breakdown (hooked)"
        if "plain_step_ms" in a:
            title += (f": step {a['hooked_step_ms']:.2f} ms with hooks, {a['plain_step_ms']:.2f} ms without "
                      f"({a['hook_overhead_pct']:+.0f}% instrumentation)")
    fig.update_layout(title=title, xaxis_title="ms per step (median)", yaxis_autorange="reversed",
                      height=80 + 36 * len(df), margin=dict(l=90, r=20, t=50, b=40))
    return fig


def comparison_bar(df, title: str = "Comparison"):
    """One small bar chart per column of ``df`` (so columns may have different units), one
    bar per row (index = the things compared, for example engines)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    cols = [c for c in df.columns if np.issubdtype(np.asarray(df[c]).dtype, np.number)]
    if not cols:
        raise ValueError("comparison_bar: df has no numeric columns")
    fig = make_subplots(rows=1, cols=len(cols), subplot_titles=[str(c) for c in cols])
    names = [str(i) for i in df.index]
    for j, c in enumerate(cols, 1):
        vals = [float(v) for v in df[c]]
        fig.add_trace(go.Bar(x=names, y=vals, text=[f"{v:.3g}" for v in vals], textposition="auto",
                             marker_color=[f"hsl({(k * 137) % 360},55%,50%)" for k in range(len(names))],
                             showlegend=False, hovertemplate="%{x}: %{y:.4g}<extra></extra>"), row=1, col=j)
    fig.update_layout(title=title, height=360, margin=dict(l=50, r=20, t=70, b=40))
    return fig
