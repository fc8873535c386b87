"""Views of the prefetcher (plotly / ipywidgets imported lazily, inside).

* :func:`timeline_figure` - a static Gantt chart of ``Prefetcher.timeline()``: one row per lane
  (copy / compute / stall), x in ms, one bar trace per lane (arrays, not a trace per event),
  step boundaries as thin vertical lines.  Compute and copy bars share a colour per layer, so
  the copy that feeds a layer's compute is easy to find; stalls are red.
* :class:`PrefetchTimelineView` - the same chart live (a FigureWidget, last ``window_s``
  seconds) with a one-line stats header; ``update()`` from a loop (throttled to
  ``refresh_hz``), ``static()`` for reports (a saved FigureWidget's state is stale).

* :func:`timeline_replay` - the whole timeline with one frame per step: the view pans over it the
  way the live view scrolled, step by step, with play / pause, speeds and a scrubber
  (:mod:`workbench.lab.replay`); the frames change only the x range and the title, so a replay
  costs a few hundred bytes a step.  :meth:`PrefetchTimelineView.replay` is the live run's,
  from the steps it recorded while the tokens came.

The static figures of sweep tables (distance, resident fraction, block size) are in
:mod:`workbench.lab.prefetch_sweeps`.
"""

from __future__ import annotations

import html
import math
import re
import time
from collections.abc import Callable

import numpy as np

from workbench.errors import ConfigError
from workbench.lab.replay import Frame, Recorder, replay_figure
from workbench.lab.viz import store_figure_state

LANES = ("copy", "compute", "stall")                  # rows, top to bottom
LAYER_COLORS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#72b7b2", "#eeca3b", "#9d755d", "#bab0ac")
STALL_COLOR = "#d62728"
STEP_LINE = "rgba(80,80,80,0.45)"
MAX_STEP_LABELS = 12


def _fmt_bytes(n: float) -> str:
    units, i = ("B", "KiB", "MiB", "GiB", "TiB"), 0
    while abs(n) >= 1024 and i < len(units) - 1:
        n, i = n / 1024, i + 1
    return f"{n:.0f} {units[i]}" if n == int(n) else f"{n:.4g} {units[i]}"


def _last_steps(events: list[dict], max_steps: int | None) -> list[dict]:
    if not max_steps or not events:
        return events
    keep = set(sorted({e["step"] for e in events})[-max_steps:])
    return [e for e in events if e["step"] in keep]


def _step_starts(events: list[dict]) -> dict[int, float]:
    """Step -> its first compute/stall start (copies are stamped with the step that *used* them,
    so a copy prefetched across the boundary would move the line early); copies only as a fallback."""
    marks = [e for e in events if e["lane"] != "copy"] or events
    out: dict[int, float] = {}
    for e in marks:
        out[e["step"]] = min(out.get(e["step"], math.inf), e["start"])
    return dict(sorted(out.items()))


def _layer_index(label: str) -> int:
    """The colour slot of an event: its layer number - the first run of digits ("layer.3",
    "L3 h1 b22 k" -> 3), so a routed block's head and block numbers do not change its colour."""
    m = re.search(r"\d+", str(label))
    return int(m.group()) % len(LAYER_COLORS) if m else len(LAYER_COLORS) - 1


LAYER_SCALE = [[(i + k) / len(LAYER_COLORS), c] for i, c in enumerate(LAYER_COLORS) for k in (0, 1)]


def _lane_arrays(events: list[dict], lane: str) -> dict:
    """One lane's bar arrays (numpy, so plotly does not validate them element by element):
    x (duration ms), base (start ms), y, text, customdata, marker (colour = layer, via a
    discrete colour scale; stalls red)."""
    evs = [e for e in events if e["lane"] == lane]
    dur = np.array([(e["end"] - e["start"]) * 1e3 for e in evs], dtype=float)
    custom = np.empty((len(evs), 6), dtype=object)
    for k, (e, d) in enumerate(zip(evs, dur)):
        nb = e.get("bytes") or 0
        gbps = nb / (d / 1e3) / 1e9 if nb and d > 0 else None
        custom[k] = (e["label"], e["step"], round(e["start"] * 1e3, 4), round(float(d), 4),
                     _fmt_bytes(nb) if nb else "-", f"{gbps:.2f}" if gbps is not None else "-")
    line = dict(width=0.5 if len(evs) <= 200 else 0, color="white")
    marker = (dict(color=STALL_COLOR, line=line) if lane == "stall" else
              dict(color=np.array([_layer_index(e["label"]) + 0.5 for e in evs]), colorscale=LAYER_SCALE,
                   cmin=0, cmax=len(LAYER_COLORS), line=line, showscale=False))
    return {"x": dur, "base": np.array([e["start"] * 1e3 for e in evs], dtype=float),
            "y": np.array([lane] * len(evs), dtype=object), "text": np.array([e["label"] for e in evs], dtype=object),
            "customdata": custom, "marker": marker}


def _step_arrays(starts: dict[int, float]) -> dict:
    xs, ys, hover = [], [], []
    for step, t in starts.items():
        xs += [t * 1e3, t * 1e3, None]
        ys += [0, 1, None]
        hover += [f"step {step} starts at {t * 1e3:.2f} ms"] * 2 + [None]
    return {"x": xs, "y": ys, "hovertext": hover}


HOVER = {
    "copy": "copy %{customdata[0]} (used in step %{customdata[1]})<br>start %{customdata[2]:.3f} ms, "
            "%{customdata[3]:.3f} ms<br>%{customdata[4]} at %{customdata[5]} GB/s<extra></extra>",
    "compute": "compute %{customdata[0]} (step %{customdata[1]})<br>start %{customdata[2]:.3f} ms, "
               "%{customdata[3]:.3f} ms<extra></extra>",
    "stall": "stall: waiting for %{customdata[0]} (step %{customdata[1]})<br>start %{customdata[2]:.3f} ms, "
             "%{customdata[3]:.3f} ms<extra></extra>",
}


def _annotations(events: list[dict], starts: dict) -> list[dict]:
    """"No events" on an empty chart; "step n" atop each step line when there are few (no overlap)."""
    if not events:
        return [dict(text="no prefetch events recorded (yet)", xref="paper", yref="paper", x=0.5, y=0.5,
                     showarrow=False, font=dict(size=14, color="gray"))]
    if len(starts) > MAX_STEP_LABELS:
        return []
    lo, hi = min(e["start"] for e in events), max(e["end"] for e in events)
    out, last = [], -math.inf
    for n, t in starts.items():
        if t - last >= 0.05 * (hi - lo):          # ~50 px on a 1000 px chart: labels never overlap
            out.append(dict(text=f"step {n}", x=t * 1e3, xref="x", y=1.0, yref="paper", yanchor="bottom",
                            xanchor="left", showarrow=False, font=dict(size=10, color="#555")))
            last = t
    return out


def _summary(events: list[dict], starts: dict) -> str:
    if not events:
        return ""
    by = {lane: sum(e["end"] - e["start"] for e in events if e["lane"] == lane) * 1e3 for lane in LANES}
    return (f": {len(starts)} steps, compute {by['compute']:.1f} ms, copy {by['copy']:.1f} ms, "
            f"stall {by['stall']:.1f} ms")


def timeline_figure(events: list[dict], title: str = "Prefetch timeline", max_steps: int | None = None,
                    height: int = 300):
    """A static Gantt chart of ``Prefetcher.timeline()`` events.  Rows: copy, compute, stall;
    bars start at ``start`` (ms) and last ``end - start``; each bar is labelled with its layer
    (the label hides where the bar is too narrow).  Hover: label, step, start, duration, and for
    copies bytes and GB/s.  Thin vertical lines mark where each step's first compute (or stall)
    starts.  ``max_steps``: keep only the last N steps.  Traces, in order: copy, compute, stall
    (one ``go.Bar`` each, ``orientation="h"``), steps (a ``go.Scatter`` on a hidden y axis)."""
    import plotly.graph_objects as go

    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise ConfigError(f"timeline_figure: max_steps={max_steps!r} must be an integer >= 1 (or None)")
    events = _last_steps(list(events), max_steps)
    starts = _step_starts(events)
    fig = go.Figure()
    for lane in LANES:
        a = _lane_arrays(events, lane)
        fig.add_trace(go.Bar(orientation="h", x=a["x"], base=a["base"], y=a["y"], text=a["text"],
                             customdata=a["customdata"], name=lane, marker=a["marker"],
                             opacity=0.6 if lane == "copy" else 0.95, hovertemplate=HOVER[lane],
                             textposition="inside", insidetextanchor="middle", textangle=0,
                             showlegend=False, width=0.8))
    s = _step_arrays(starts)
    fig.add_trace(go.Scatter(x=s["x"], y=s["y"], yaxis="y2", mode="lines", name="step start", showlegend=False,
                             line=dict(color=STEP_LINE, width=1), hovertext=s["hovertext"], hoverinfo="text"))
    fig.update_layout(
        title=dict(text=title + _summary(events, starts), x=0.01, y=0.98, yanchor="top"), height=height,
        barmode="overlay", margin=dict(l=70, r=20, t=60, b=45), uniformtext=dict(minsize=8, mode="hide"),
        xaxis=dict(title="ms since the first event", showgrid=True, **({} if events else {"range": [0, 1]})),
        yaxis=dict(type="category", categoryorder="array", categoryarray=list(LANES), range=[len(LANES) - 0.5, -0.5],
                   fixedrange=True),
        yaxis2=dict(overlaying="y", range=[0, 1], visible=False, fixedrange=True),
        annotations=_annotations(events, starts), plot_bgcolor="white")
    fig.update_xaxes(gridcolor="#eee")
    return fig


def _so_far(events: list[dict]) -> str:
    by = {lane: sum(e["end"] - e["start"] for e in events if e["lane"] == lane) * 1e3 for lane in LANES}
    return f"compute {by['compute']:.1f} ms, copy {by['copy']:.1f} ms, stall {by['stall']:.1f} ms so far"


def timeline_replay(events: list[dict], marks: list[tuple[float, int]] | None = None, window_ms: float | None = None,
                    title: str = "Prefetch timeline", height: int = 300, note: str | None = None):
    """``timeline_figure(events)`` with one frame per step, for a learner to step through.

    ``marks``: ``(t_ms, step)`` pairs recorded during the run (the frame's time on the slider, and
    the last step it shows); default: every step of ``events``, at the end of its last event.
    Frame ``k`` shows what had happened by the end of step ``s_k``: the x range spans ``window_ms``
    (default: three steps) and ends at the last event of the steps up to ``s_k``; until the run has
    filled it, it starts where the run's first step does and a curtain covers what had not happened
    yet.  Only the
    x range and the title change per frame, so the frames are small whatever the event count."""
    events = list(events)
    fig = timeline_figure(events, title=title, height=height)
    if not events:
        return fig
    steps = sorted({e["step"] for e in events})
    if marks is None:
        ends = {s: max(e["end"] for e in events if e["step"] == s) * 1e3 for s in steps}
        marks = [(ends[s], s) for s in steps]
    starts = _step_starts(events)
    if window_ms is None:
        st = [starts[s] * 1e3 for s in steps if s in starts]
        gaps = sorted(b - a for a, b in zip(st, st[1:]))
        window_ms = 3 * gaps[len(gaps) // 2] if gaps else max(e["end"] for e in events) * 1e3
    # the run starts with the step before the first one marked (the prefill, when marks come per token)
    s0 = min(s for _, s in marks) - 1 if marks else steps[0]
    work = [e["start"] for e in events if e["lane"] != "copy" and e["step"] >= s0] or [e["start"] for e in events]
    lo = min(work) * 1e3
    frames = []
    for t_ms, s in marks:
        done = [e for e in events if e["step"] <= s]
        if not done:
            continue
        hi = max(e["end"] for e in done) * 1e3
        left = max(lo, hi - window_ms)          # the window fills from the run's start, then scrolls with it
        curtain = {"type": "rect", "xref": "x", "yref": "paper", "x0": hi, "x1": left + window_ms, "y0": 0, "y1": 1,
                   "fillcolor": "rgba(255,255,255,0.88)", "line": {"width": 1, "color": "#888", "dash": "dot"},
                   "layer": "above"}             # what had not happened yet, while the window fills
        frames.append(Frame(t_ms, [], f"step {s}", {
            "xaxis": {"range": [left, left + window_ms], "autorange": False}, "shapes": [curtain],
            "title": {"text": f"{title}<br><sup>up to step {s}: {_so_far(done)}</sup>", "x": 0.01, "y": 0.95,
                      "yanchor": "top"}}))
    if not frames:
        return fig
    fig.update_layout(annotations=[a for a in fig.layout.annotations if not str(a.text).startswith("step ")])
    fig = replay_figure(fig, frames, redraw=True, time_label="run time", note=note)
    fig.layout.sliders[0].currentvalue.font.color = "#333"      # many frames: the step labels' font is transparent
    return fig


class PrefetchTimelineView:
    """The prefetch timeline live, over the last ``window_s`` seconds, with a stats line::

        view = PrefetchTimelineView(streamer, window_s=0.5).show()
        for ev in llm.stream(prompt, params):
            view.update()                      # redraws at most refresh_hz times a second
        view.update(force=True); view.static()   # the whole run as a plain go.Figure

    ``source``: a :class:`~workbench.prefetch.weights.WeightStreamer` (its ``prefetcher`` and
    ``stats()``) or a :class:`~workbench.prefetch.prefetcher.Prefetcher`.  ``clock`` paces the
    redraws (``time.monotonic``)."""

    def __init__(self, source, window_s: float = 0.25, refresh_hz: float = 10.0, title: str = "Prefetch (live)",
                 height: int = 300, clock: Callable[[], float] = time.monotonic, record: bool = True) -> None:

        if not 0 < refresh_hz <= 20:
            raise ConfigError(f"PrefetchTimelineView: refresh_hz={refresh_hz!r} must be in (0, 20]")
        if not window_s > 0:
            raise ConfigError(f"PrefetchTimelineView: window_s={window_s!r} must be > 0 seconds")
        self.source = source
        self.prefetcher = getattr(source, "prefetcher", source)
        if not callable(getattr(self.prefetcher, "timeline", None)):
            raise ConfigError(f"PrefetchTimelineView: {type(source).__name__} has no timeline(); pass a "
                              "WeightStreamer or a Prefetcher")
        self.window_s, self.min_interval, self.title, self.height = window_s, 1.0 / refresh_hz, title, height
        self.clock = clock
        self._last_draw = -math.inf
        self.redraws = 0
        self.redraw_seconds = 0.0
        # the replay's record: the step the prefetcher is at, on every token (unchanged steps dropped)
        self.recorder = Recorder(clock=clock) if record else None
        self.record_events, self.record_seconds = 0, 0.0
        self._build()

    def _build(self) -> None:
        """The widgets (again after a run ended and replaced them: see :meth:`run`)."""
        import ipywidgets as widgets
        import plotly.graph_objects as go

        from workbench.lab.live_output import LiveOutput

        self.live = LiveOutput()
        self.fig = go.FigureWidget(timeline_figure([], title=self.title, height=self.height))
        self.label = widgets.HTML(value=self._stats_html(), layout=widgets.Layout(width="100%", overflow="hidden"))
        self.widget = widgets.VBox([self.label, self.fig])
        self.widget.add_class("wb-live")                   # found by the browser test (workbench.lab.browser)
        self.widget.add_class("wb-live-prefetch-timeline")

    # ---- display ------------------------------------------------------------------------------
    def _repr_mimebundle_(self, **kwargs):
        if self.fig is None:
            self._build()
        return self.widget._repr_mimebundle_(**kwargs)

    def show(self) -> PrefetchTimelineView:
        """Show the live widget; :meth:`run` replaces it with a line when its run ends (the replay
        has the run: a saved notebook then holds no widget, see
        :class:`~workbench.lab.live_output.LiveOutput`)."""
        if self.fig is None or self.live.shown:
            self._build()
        self.live.show(self.widget, self.fig, self.label)
        return self

    # ---- data ---------------------------------------------------------------------------------
    def window(self) -> list[dict]:
        """The events that end within the last ``window_s`` seconds of the timeline."""
        evs = self.prefetcher.timeline()
        if not evs:
            return []
        cut = max(e["end"] for e in evs) - self.window_s
        return [e for e in evs if e["end"] >= cut]

    def stats(self) -> dict:
        return self.source.stats() if callable(getattr(self.source, "stats", None)) else {}

    def _stats_html(self, s: dict | None = None) -> str:
        s = s or {}
        pct = lambda v: "-" if v is None else f"{v:.0%}"
        parts = [f"hit rate <b>{pct(s.get('prefetch_hit_rate'))}</b>",
                 f"stall <b>{s['stall_s'] * 1e3:.1f} ms</b>" if s.get("stall_s") is not None else "stall -",
                 f"efficiency <b>{pct(s.get('prefetch_efficiency'))}</b>",
                 f"<b>{s['achieved_gbps']:.2f} GB/s</b>" if s.get("achieved_gbps") is not None else "- GB/s",
                 f"fetches {s.get('fetches', 0)} ({s.get('demand', 0)} demand)"]
        if "distance" in s:
            parts.append(f"d={s['distance']}, resident {s.get('resident_layers')}/"
                         f"{s.get('resident_layers', 0) + s.get('streamed_layers', 0)} layers")
        if s.get("link") or s.get("transport"):
            parts.append(html.escape(str(s.get("link") or s.get("transport"))))
        parts.append(f"redraws {self.redraws}")
        return ("<div style='white-space:nowrap;overflow:hidden;text-overflow:ellipsis;max-width:100%'>"
                + " &middot; ".join(p for p in parts if p) + "</div>")

    # ---- drawing ------------------------------------------------------------------------------
    def update(self, force: bool = False) -> bool:
        """Redraw from the recorded events if ``1 / refresh_hz`` has passed since the last redraw
        (or ``force``); returns whether it redrew."""
        if not force and self.clock() - self._last_draw < self.min_interval:
            return False
        if self.fig is None:                  # a run that showed it has ended and closed the widgets
            self._build()
        t0 = time.monotonic()
        evs = self.window()
        starts = _step_starts(evs)
        s = self.stats()
        with self.fig.batch_update():
            for tr, lane in zip(self.fig.data, LANES):
                a = _lane_arrays(evs, lane)
                tr.update(x=a["x"], base=a["base"], y=a["y"], text=a["text"], customdata=a["customdata"],
                          marker=a["marker"])
            st = _step_arrays(starts)
            self.fig.data[len(LANES)].update(x=st["x"], y=st["y"], hovertext=st["hovertext"])
            if evs:
                hi = max(e["end"] for e in evs) * 1e3
                self.fig.layout.xaxis.range = [max(0.0, hi - self.window_s * 1e3), hi]
            self.fig.layout.annotations = _annotations(evs, starts)
            self.fig.layout.title.text = f"{self.title}: last {self.window_s * 1e3:g} ms" if evs else self.title
        self.redraws += 1
        self.redraw_seconds += time.monotonic() - t0
        self.label.value = self._stats_html(s)
        self._last_draw = self.clock()
        return True

    def run(self, llm, prompt, params=None, display: bool = True):
        """Stream one request through ``llm`` while the view updates; returns its RequestOutput."""
        from workbench.engine.llm import RequestOutput

        if display:
            self.show()
        out = RequestOutput(request_id="", prompt=None, prompt_token_ids=[])
        for _ in llm.stream(prompt, params, output=out):
            self.mark()
            self.update()
        self.mark()
        self.update(force=True)
        if self.live.shown:         # its place: a line; the replay steps through the run
            self.live.end(note=f"The live view has ended: {self.redraws} redraws. Its replay (replay()) steps "
                               "through the run.")
            self.fig = None
        else:
            store_figure_state(self.fig, send=True)    # a view the browser draws late shows the whole run
        return out

    def mark(self) -> None:
        """Record where the run is (the prefetcher's step, on the view's clock): one replay frame."""
        if self.recorder is None:
            return
        t0 = time.monotonic()
        self.recorder.add([{"step": int(getattr(self.prefetcher, "step", 0))}])
        self.record_events += 1
        self.record_seconds += time.monotonic() - t0

    def record_cost(self) -> str:
        if self.recorder is None or not self.record_events:
            return "nothing recorded"
        return (f"recorded {len(self.recorder.frames)} steps on {self.record_events} tokens in "
                f"{self.record_seconds * 1e3:.2f} ms: {self.record_seconds / self.record_events * 1e6:,.1f} µs per "
                "token")

    def replay(self, title: str | None = None):
        """The whole run's timeline, one frame per recorded step, panned as the live view scrolled
        (:func:`timeline_replay`, window ``window_s``), with what recording cost under it."""
        marks = None if self.recorder is None else [(f.t_ms, f.data[0]["step"]) for f in self.recorder.frames]
        return timeline_replay(self.prefetcher.timeline(), marks=marks or None, window_ms=self.window_s * 1e3,
                               title=title or self.title.replace(" (live)", ""), height=self.height,
                               note=self.record_cost())

    def static(self, max_steps: int | None = None, title: str | None = None):
        """A plain ``go.Figure`` of the whole recorded timeline (safe to save in reports)."""
        return timeline_figure(self.prefetcher.timeline(), title=title or self.title.replace(" (live)", ""),
                               max_steps=max_steps, height=self.height)
