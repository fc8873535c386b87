"""Live and static views of a load run (plotly / ipywidgets imported lazily, inside).

* :class:`LatencyDashboard` - a FigureWidget with four rows, live while a run goes:
  TTFT P50/P95/P99 over a rolling window (and the SLO guard's threshold); inter-token
  latency P50/P95/P99 over the same window (gaps of finished requests); load: requests in
  flight (client side), queue length / running / batch size (when the target exposes them)
  and requests rejected so far; KV usage and the SLO guard's state.  Redrawn at most
  ``max_hz`` times a second (3 by default: a redraw of four subplots is a browser task of
  tens of ms, and ten a second kept JupyterLab busy for seconds) inside ``batch_update()``,
  each trace thinned to ``max_points`` points; ``static_figure()`` for reports (a saved
  FigureWidget's state is stale).  One horizontal legend above the rows (one entry per
  percentile for both latency rows), so the plots keep the cell's width; the status line
  above the figure has a fixed height (two lines that never wrap), so the figure does not move
  while the run goes.  Every sample is also *recorded* (:class:`~workbench.lab.replay.Recorder`,
  with or without the widget: ``live=False`` draws nothing and records the same frames), and
  :meth:`LatencyDashboard.replay` turns the recording into a plain plotly figure with play /
  pause / speed and a scrubber in ms, which :meth:`LatencyDashboard.finish` puts in place of
  the live widget when the run ends (so a saved notebook reopens with the figure, not "model not
  found").
* :func:`scheduler_timeline` - per engine step; it lives in :mod:`workbench.lab.sched_timeline`
  and is re-exported here.
* :func:`latency_vs_load_figure` - P50/P95 TTFT against offered load, one line per setting
  (for example per micro-batch window) from a sweep table.

Target metrics come from ``metrics_fn() -> dict`` (the in-process engine, ``FakeTarget.metrics``,
``GuardedTarget.metrics`` or a server's ``/metrics`` through
:func:`workbench.lab.prom_metrics.http_metrics_fn`).  It is polled on a background thread
at ``metrics_hz``, so a slow HTTP poll never stalls the load generator's event loop.  Keys are
matched by suffix, so ``queue_len`` (the in-process engine), ``workbench_queue_length`` (the
workbench server's ``/metrics``) and vLLM's ``vllm:num_requests_waiting`` all land on the
queue-length line.
"""

from __future__ import annotations

import html
import math
import re
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from workbench.errors import ConfigError
from workbench.lab.live_output import in_kernel
from workbench.lab.replay import Recorder
from workbench.lab.sched_timeline import TIMELINE_COLUMNS, scheduler_timeline, tidy_replay  # noqa: F401  (re-exported)
from workbench.lab.viz import store_figure_state

# series name -> metric-name suffixes that feed it (first match wins)
ALIASES = {
    "queue_len": ("queue_len", "queue_length", "num_requests_waiting", "waiting"),
    "running": ("running", "running_requests", "num_requests_running"),
    "batch_size": ("batch_size",),
    "kv_usage": ("kv_usage", "kv_usage_ratio", "kv_cache_usage_perc", "gpu_cache_usage_perc"),
}
STATE_LEVEL = {"closed": 0, "half_open": 1, "open": 2}
# one colour per percentile, the same in the TTFT and the ITL rows (Okabe-Ito: colour-blind safe)
P50, P95, P99 = "#0072B2", "#E69F00", "#D55E00"
ALERT = "firebrick"                     # a count that should be 0 (errors, rejected) when it is not
SERIES = ("t", "ttft_p50", "ttft_p95", "ttft_p99", "threshold", "itl_p50", "itl_p95", "itl_p99", "in_flight",
          "queue_len", "running", "batch_size", "kv_usage", "rejected", "slo_state")
# the dashboard's traces, in order: (series, name, subplot row, line style).  One legend entry per
# percentile for both latency rows (the ITL traces share the TTFT traces' colour and legend group,
# so clicking "P95" toggles both); every other series has its own entry.
TRACES = (("ttft_p50", "P50", 1, dict(color=P50)), ("ttft_p95", "P95", 1, dict(color=P95)),
          ("ttft_p99", "P99", 1, dict(color=P99)), ("threshold", "SLO threshold", 1, dict(dash="dash", color="gray")),
          ("itl_p50", "ITL P50", 2, dict(color=P50)), ("itl_p95", "ITL P95", 2, dict(color=P95)),
          ("itl_p99", "ITL P99", 2, dict(color=P99)),
          ("in_flight", "in flight (client)", 3, dict(color="#009E73")),
          ("queue_len", "queue", 3, dict(color="#CC79A7")), ("running", "running", 3, dict(color="#56B4E9")),
          ("batch_size", "batch size", 3, dict(dash="dot", color="#000000")),
          ("rejected", "rejected (total)", 3, dict(color=ALERT)),
          ("kv_usage", "KV usage %", 4, dict(color="#8C564B")), ("slo_state", "SLO state", 4, dict(color="#9467BD")))
# what the hover says for each series (the legend names of the latency rows are just "P50" ...)
HOVER = {"ttft_p50": "TTFT P50", "ttft_p95": "TTFT P95", "ttft_p99": "TTFT P99", "itl_p50": "ITL P50",
         "itl_p95": "ITL P95", "itl_p99": "ITL P99", "slo_state": "SLO state (0 closed, 1 half-open, 2 open)"}
STATUS_LINE_PX = 22                     # the status label: two lines of this height, never wrapped
FIT_EVERY_S = 2.0                       # while redrawing: ask the browser to fit the figure to its cell this often
MAX_HZ = 3.0                            # redraws a second (a few: each is a browser task of tens of ms)
MAX_POINTS = 240                        # points per trace sent in a redraw (older samples thinned)
REPLAY_FRAMES = 60                      # frames kept for a ramp's replay (evenly spaced, first and last kept)
# rounding of the recorded frames' values (a replay's size): ms to 0.1, counts to 1
_DIGITS = {"in_flight": 0, "queue_len": 0, "running": 0, "batch_size": 0, "rejected": 0, "slo_state": 0}
_LINE_STYLE = (f"white-space:nowrap;overflow:hidden;text-overflow:ellipsis;height:{STATUS_LINE_PX}px;"
               f"line-height:{STATUS_LINE_PX}px;font-variant-numeric:tabular-nums")
# the HTML widget's content box is a flex item that grows with its text; this lets it shrink to
# the cell's width, so that a line too long ends in an ellipsis instead of being cut
_STATUS_CSS = "<style>.wb-status .widget-html-content{min-width:0;width:100%;overflow:hidden}</style>"


def count_html(name: str, n: int, alert: bool = False) -> str:
    """``name n`` for the status line; with ``alert`` (a count that should stay 0: errors,
    rejected requests) it is red, but only when ``n`` is not 0::

        count_html("rejected", 0, alert=True)   # 'rejected 0'
        count_html("rejected", 3, alert=True)   # "<span style='color:firebrick'>rejected 3</span>"
    """
    text = f"{html.escape(name)} {n}"
    return f"<span style='color:{ALERT}'>{text}</span>" if alert and n else text


def status_lines_html(lines) -> str:
    """The status label's HTML: one ``div`` per line, each a fixed height that never wraps
    (a line too long for the cell ends in an ellipsis; its full text is the tooltip)."""
    out = []
    for line in lines:
        plain = html.escape(html.unescape(re.sub(r"<[^>]+>", "", line)), quote=True)
        out.append(f"<div style='{_LINE_STYLE}' title='{plain}'>{line or '&nbsp;'}</div>")
    return _STATUS_CSS + "".join(out)


def pick_metrics(m: dict) -> dict:
    """Map a metrics dict onto the dashboard's series (None where absent)."""
    out = {}
    for series, names in ALIASES.items():
        out[series] = None
        for name in names:
            hit = next((v for k, v in m.items() if str(k).split("{")[0].endswith(name)), None)
            if hit is not None:
                out[series] = float(hit)
                break
    if out["kv_usage"] is not None and out["kv_usage"] <= 1.0:
        out["kv_usage"] *= 100.0          # fractions -> percent
    return out


class LatencyDashboard:
    """Live latency / load / SLO view of a :class:`~workbench.load.generator.LoadRun`::

        run = LoadRun(target, cfg)
        dash = LatencyDashboard(metrics_fn=target.metrics, guard=guard).attach(run)
        dash.display(); result = run.run()      # or: await run.arun()
        dash.static_figure()

    Or feed it by hand: ``dash.update(t=..., record=..., in_flight=..., rejected=...)``.
    ``clock`` paces the redraws (at most ``max_hz``): the run's clock, ``time.monotonic`` by
    default (a virtual-time run passes its loop's ``loop.time``).  The displayed view carries the
    CSS classes ``wb-live`` and ``wb-live-<name>`` (for a browser run to find it).

    ``live``: ``True`` a FigureWidget in a VBox (its first view starts plotly's 4.8 MB widget bundle:
    seconds of a busy browser on a small machine); ``"svg"`` the same four rows drawn as SVG in an
    HTML output replaced in place at each redraw (:meth:`svg_html`: a few ms for the browser, no
    widget, so a notebook saved mid-run keeps it; what notebook 04 uses); ``False`` no view.  In
    every mode each sample is recorded as a frame (``recorder``, its cost in ``record_seconds``)
    and :meth:`finish` turns the recording into :meth:`replay`, in place of the live view.
    """

    def __init__(self, window_s: float = 10.0, max_hz: float = MAX_HZ, metrics_fn: Callable[[], dict] | None = None,
                 metrics_hz: float = 3.0, guard=None, title: str = "Load (live)", height: int = 820,
                 clock: Callable[[], float] = time.monotonic, name: str = "load-dashboard", live: bool | str = True,
                 max_points: int = MAX_POINTS, max_frames: int = REPLAY_FRAMES) -> None:
        import plotly.graph_objects as go

        if not 0 < max_hz <= 10:
            raise ConfigError(f"LatencyDashboard: max_hz={max_hz!r} must be in (0, 10]")
        if not 0 < metrics_hz <= 10:
            raise ConfigError(f"LatencyDashboard: metrics_hz={metrics_hz!r} must be in (0, 10]")
        if not window_s > 0:
            raise ConfigError(f"LatencyDashboard: window_s={window_s!r} must be > 0 seconds")
        if live not in (True, False, "svg"):
            raise ConfigError(f"LatencyDashboard: live={live!r} must be True (a FigureWidget), 'svg' (HTML, no "
                              "widget) or False (no view, frames recorded)")
        if not (isinstance(max_points, int) and max_points >= 2):
            raise ConfigError(f"LatencyDashboard: max_points={max_points!r} must be an integer >= 2")
        self.window_s, self.min_interval, self.metrics_interval = window_s, 1.0 / max_hz, 1.0 / metrics_hz
        self.metrics_fn, self.guard, self.title, self.height = metrics_fn, guard, title, height
        self.clock = clock                      # paces redraws (max_hz) and inline polls: the run's clock
        self.live, self.max_points, self.name = live, max_points, name
        self.fig = self.label = self.widget = None
        # "svg": HTML redrawn in place; False: no view, frames recorded all the same
        if live is True:
            import ipywidgets as widgets

            self.fig = go.FigureWidget(self._figure(go))
            # a fixed-height status label: the figure below it never moves when the text changes
            self.label = widgets.HTML(value=status_lines_html(["<b>waiting for the run to start...</b>", ""]),
                                      layout=widgets.Layout(height=f"{2 * STATUS_LINE_PX}px", width="100%",
                                                            overflow="hidden"))
            self.label.add_class("wb-status")
            self.widget = widgets.VBox([self.label, self.fig])
            self.widget.add_class("wb-live")
            self.widget.add_class(f"wb-live-{name}")
        self.recorder = Recorder(max_frames=10_000)   # every sample; thinned to max_frames by replay()
        self.max_frames = max_frames
        self.record_seconds = 0.0               # building + storing the frames (the recorder's own time included)
        self.events = 0                         # observer calls (finished requests and ticks) seen
        self._handle = None                     # the display handle, when displayed (finish() replaces it)
        self.data = {k: [] for k in SERIES}
        self._ttfts: deque = deque()            # (end time, ttft ms) of ok requests in the window
        self._itls: deque = deque()             # (token time, gap ms) of ok requests' tokens
        self._latest: dict = {}                 # last polled target metrics
        self.metrics_error: str | None = None
        self._last_draw = -math.inf
        self._last_fit = -math.inf
        self._last_poll = -math.inf
        self._poller: threading.Thread | None = None
        self._stop = threading.Event()
        self.redraws = 0
        self.redraw_seconds = 0.0
        self.status: dict = {}

    # ---- figure ---------------------------------------------------------------------------------
    def _figure(self, go, data: dict | None = None):
        from plotly.subplots import make_subplots

        d = data or {k: [] for k in SERIES}
        fig = make_subplots(rows=4, cols=1, shared_xaxes=True, vertical_spacing=0.06,
                            specs=[[{}], [{}], [{}], [{"secondary_y": True}]],
                            subplot_titles=(f"TTFT over the last {self.window_s:g} s (ms)",
                                            f"inter-token latency over the last {self.window_s:g} s (ms)",
                                            "load: requests", "KV usage and SLO guard"))
        t = d["t"]
        for key, name, row, style in TRACES:
            line = dict(style, shape="hv") if key == "slo_state" else style
            kw = dict(fill="tozeroy", opacity=0.3) if key == "slo_state" else {}
            if key[-3:] in ("p50", "p95", "p99"):         # one legend entry per percentile, for both rows
                kw.update(legendgroup=key[-3:], showlegend=row == 1)
            unit = {1: " ms", 2: " ms", 4: " %" if key == "kv_usage" else ""}.get(row, "")
            fig.add_trace(go.Scatter(x=t, y=d[key], mode="lines", name=name, line=line,
                                     hovertemplate=f"{HOVER.get(key, name)}: %{{y:.4~g}}{unit} at %{{x:.1f}} s"
                                                   "<extra></extra>", **kw),
                          row=row, col=1, secondary_y=key == "slo_state")
        for row in (1, 2, 3):
            fig.update_yaxes(rangemode="tozero", row=row, col=1)
        # row 4: KV usage in % on the left, the guard's state on the right; secondary_y=False
        # matters: without it the first call would style the state axis too
        fig.update_yaxes(title_text="KV %", range=[0, 105], tickvals=[0, 25, 50, 75, 100], row=4, col=1,
                         secondary_y=False)
        fig.update_yaxes(title_text="SLO guard", range=[-0.1, 2.3], tickvals=[0, 1, 2],
                         ticktext=["closed", "half-open", "open"], showgrid=False, row=4, col=1, secondary_y=True)
        fig.update_xaxes(title_text="seconds since the start", row=4, col=1)
        # one horizontal legend between the title and the first row: the plots keep the full width
        # (a FigureWidget does not draw figures with several legends, so it is one for all rows)
        fig.update_layout(title=dict(text=self.title, y=1, yanchor="top", yref="container", pad=dict(t=12)),
                          height=self.height, margin=dict(l=60, r=80, t=110, b=40),
                          legend=dict(orientation="h", x=0, xanchor="left", y=1.035, yanchor="bottom",
                                      itemwidth=30, tracegroupgap=4, font=dict(size=11)))
        return fig

    def _repr_mimebundle_(self, **kwargs):
        if self.widget is None:
            return self.static_figure()._repr_mimebundle_(**kwargs)
        return self.widget._repr_mimebundle_(**kwargs)

    def display(self) -> LatencyDashboard:
        """Show the live view (with a display id: :meth:`finish` replaces it by the replay)."""
        from IPython.display import HTML, display

        if self.live == "svg":
            self._handle = display(HTML(self.svg_html()), display_id=True)
        elif self.widget is not None:
            self._handle = display(self.widget, display_id=True)
        else:
            raise ConfigError("LatencyDashboard(live=False) has no view to display; show replay() instead")
        return self

    def svg_html(self) -> str:
        """The live view as HTML (``live="svg"``): the two status lines, a legend and the four rows
        drawn as one SVG, in a ``div`` with the classes ``wb-live wb-live-<name> wb-live-svg``.
        Redrawn by replacing the output (``display`` handle), which costs the browser a few ms:
        no widget, no plotly bundle to start, and a notebook saved mid-run keeps what it showed."""
        return svg_dashboard_html(self.data, self.window_s, self.title, self._status_lines(), self.name,
                                  self._shown_index())

    # ---- target metrics (background poller) -------------------------------------------------------
    def _poll_once(self) -> None:
        try:
            self._latest = pick_metrics(self.metrics_fn() or {})
            self.metrics_error = None
        except Exception as e:        # a server that stopped answering: shown, not fatal
            self.metrics_error = f"metrics_fn failed: {type(e).__name__}: {e}"

    def _poll_loop(self) -> None:
        while not self._stop.wait(self.metrics_interval):
            self._poll_once()

    def start_polling(self) -> None:
        if self.metrics_fn is not None and self._poller is None:
            self._stop.clear()
            self._poll_once()
            self._poller = threading.Thread(target=self._poll_loop, name="dashboard-metrics", daemon=True)
            self._poller.start()

    def stop_polling(self) -> None:
        self._stop.set()
        if self._poller is not None:
            self._poller.join(timeout=2 * self.metrics_interval + 1)
            self._poller = None

    # ---- feeding --------------------------------------------------------------------------------
    def attach(self, run) -> LatencyDashboard:
        """Observe a LoadRun: every finished request and every tick update the view.  Without a
        ``metrics_fn`` / ``guard`` of its own, the dashboard polls ``run.target.metrics()`` and
        shows the guard of a :class:`~workbench.serve.slo.GuardedTarget`."""
        if self.metrics_fn is None and callable(getattr(run.target, "metrics", None)):
            self.metrics_fn = run.target.metrics
        if self.guard is None and getattr(run.target, "guard", None) is not None:
            self.guard = run.target.guard
        run.add_observer(self)
        self.start_polling()
        return self

    def __call__(self, run, record) -> None:
        self.events += 1
        c = run.counts
        self.status = {"elapsed": run.elapsed(), "stage": run.stage_name, "target": run.target_value(),
                       "mode": run.config.mode, "sent": run.sent, **c, "in_flight": run.in_flight}
        self.update(t=run.elapsed(), record=record, in_flight=run.in_flight, rejected=c.get("rejected", 0),
                    force=run.done)
        if run.done:
            self.stop_polling()
            if self.fig is not None:
                store_figure_state(self.fig, send=True)   # a view the browser draws late shows the whole run

    def update(self, t: float, record=None, in_flight: int | None = None, rejected: int | None = None,
               metrics: dict | None = None, force: bool = False) -> None:
        """Add a finished request (a RequestRecord) and/or a sample at time ``t`` (s since the
        start); redraws when ``max_hz`` allows or ``force``.  ``metrics``: target metrics now
        (otherwise the latest polled ones, or a poll now if polling is not running)."""
        if record is not None and record.status == "ok" and record.ttft is not None:
            self._ttfts.append((record.end if record.end is not None else t, record.ttft * 1e3))
            tt = record.token_times
            self._itls.extend((b, (b - a) * 1e3) for a, b in zip(tt, tt[1:]))
        now = self.clock()
        if not force and now - self._last_draw < self.min_interval:
            return
        if metrics is not None:
            self._latest = pick_metrics(metrics)
        elif self.metrics_fn is not None and self._poller is None and now - self._last_poll >= self.metrics_interval:
            self._last_poll = now
            self._poll_once()
        self._sample(t, in_flight, rejected)
        self._record(t)
        if self.fig is not None:
            self._redraw()
            self._fit(now, force=force)
        elif self.live == "svg" and self._handle is not None:
            t0 = time.monotonic()
            self.redraws += 1
            from IPython.display import HTML

            self._handle.update(HTML(self.svg_html()))
            self.redraw_seconds += time.monotonic() - t0
        self._last_draw = self.clock()

    def _sample(self, t: float, in_flight, rejected) -> None:
        cut = t - self.window_s            # token times of different requests arrive out of order: filter all
        self._ttfts = deque(x for x in self._ttfts if x[0] >= cut)
        self._itls = deque(x for x in self._itls if x[0] >= cut)
        vals = [v for _, v in self._ttfts]
        p50, p95, p99 = np.percentile(vals, [50, 95, 99]) if vals else (None, None, None)
        gaps = [v for _, v in self._itls]            # finished requests' gaps, by when the later token came
        i50, i95, i99 = np.percentile(gaps, [50, 95, 99]) if gaps else (None, None, None)
        snap = self.guard.snapshot() if self.guard is not None else {}
        thr = snap.get("threshold_s")
        d, m = self.data, self._latest
        for k, v in (("t", t), ("ttft_p50", p50), ("ttft_p95", p95), ("ttft_p99", p99),
                     ("threshold", None if thr is None else thr * 1e3), ("itl_p50", i50), ("itl_p95", i95),
                     ("itl_p99", i99), ("in_flight", in_flight),
                     ("queue_len", m.get("queue_len")), ("running", m.get("running")),
                     ("batch_size", m.get("batch_size")), ("kv_usage", m.get("kv_usage")),
                     ("rejected", rejected), ("slo_state", STATE_LEVEL.get(snap.get("state")))):
            d[k].append(None if v is None else float(v))
        self.status["slo"] = snap

    def _shown_index(self) -> list[int]:
        """The samples a redraw sends: all of them up to ``max_points``, else the newest half at
        full resolution and the older ones evenly thinned (the first always kept)."""
        n = len(self.data["t"])
        if n <= self.max_points:
            return list(range(n))
        recent = self.max_points // 2
        old = n - recent
        k = self.max_points - recent
        return sorted({round(i * (old - 1) / max(1, k - 1)) for i in range(k)}) + list(range(old, n))

    def _redraw(self) -> None:
        t0 = time.monotonic()
        self.redraws += 1
        idx = self._shown_index()
        t = self.data["t"]
        xs = [t[i] for i in idx]
        with self.fig.batch_update():
            for tr, (k, *_) in zip(self.fig.data, TRACES):
                ys = self.data[k]
                if all(v is None for v in ys):
                    continue                    # nothing to draw yet (or a series this target lacks): send nothing
                tr.x, tr.y = xs, [ys[i] for i in idx]
        self.label.value = self._status_html()
        self.redraw_seconds += time.monotonic() - t0

    # ---- recording and replay ---------------------------------------------------------------------
    def _record(self, t: float) -> None:
        """One frame per sample: each trace's values so far (y only: the replay's traces carry the
        whole run's x, and plotly draws as many points as y has), rounded; the status line as the
        frame's title and its slider label."""
        t0 = time.monotonic()
        data = []
        for k, *_ in TRACES:
            ys = self.data[k]
            if all(v is None for v in ys):
                data.append({"y": []})          # nothing to draw yet (an empty dict would keep a later frame's line)
                continue
            nd = _DIGITS.get(k, 1)
            data.append({"y": [None if v is None else (round(v) if nd == 0 else round(v, nd)) for v in ys]})
        s, snap = self.status, self.status.get("slo") or {}
        p95 = self.data["ttft_p95"][-1]
        bits = [f"stage {s['stage']}"] if "stage" in s else []
        bits.append(f"TTFT P95 {p95:,.0f} ms" if p95 is not None else "no request finished yet")
        if snap:
            bits.append(f"SLO {snap['state'].replace('_', '-')}")
        label = " · ".join(bits)
        head = [f"{t:.1f} s"] + bits
        if "sent" in s:
            head.append(f"sent {s['sent']}, ok {s.get('ok', 0)}, rejected {s.get('rejected', 0)}, "
                        f"in flight {s['in_flight']}")
        self.recorder.add(data, label=label, layout={"title": {"text": f"{self.title}<br><sup>{' · '.join(head)}"
                                                                        "</sup>"}}, t_ms=t * 1e3)
        self.record_seconds += time.monotonic() - t0

    def record_cost_text(self) -> str:
        """What recording cost: per frame, and per event the dashboard observed."""
        n = len(self.recorder.frames) + self.recorder.dropped
        per_frame = self.record_seconds / n * 1e6 if n else 0.0
        per_event = self.record_seconds / self.events * 1e6 if self.events else per_frame
        return (f"recording: {n} frames in {self.record_seconds * 1e3:.1f} ms, {per_frame:.0f} µs a frame, "
                f"{per_event:.0f} µs per event observed ({self.events} finished requests and ticks)")

    def replay(self, max_frames: int | None = None):
        """The recorded run as a plain plotly figure: the dashboard's four rows with the whole
        run's axes, play / pause, speeds and a scrubber over the frames (``max_frames``, evenly
        spaced), each frame's title the status at that time.  Works without a kernel."""
        from workbench.lab.replay import replay_figure

        fig = self.static_figure()
        t = [v for v in self.data["t"] if v is not None]
        if t:
            fig.update_xaxes(range=[0, max(t) * 1.01 + 1e-3], autorange=False)
        for row, keys in ((1, ("ttft_p50", "ttft_p95", "ttft_p99", "threshold")),
                          (2, ("itl_p50", "itl_p95", "itl_p99")),
                          (3, ("in_flight", "queue_len", "running", "batch_size", "rejected"))):
            top = max((v for k in keys for v in self.data[k] if v is not None), default=0.0)
            if top > 0:                         # fixed ranges: the scale does not jump while it plays
                fig.update_yaxes(range=[0, top * 1.08], autorange=False, row=row, col=1)
        # the whole run drawn faintly behind the replay (not in the frames): the first frame, and a
        # notebook reopened on it, shows where the run goes, and the played lines fill it in
        import plotly.graph_objects as go

        for tr in list(fig.data):
            if tr.y is not None and any(v is not None for v in tr.y):
                ghost = go.Scatter(tr)
                ghost.update(opacity=0.25, showlegend=False, hoverinfo="skip", hovertemplate=None, fill=None,
                             legendgroup=None, name=f"{tr.name} (whole run)")
                fig.add_trace(ghost)
        # the replay's buttons take the row above the plots: the legend goes above them
        plot_px = fig.layout.height - fig.layout.margin.t - fig.layout.margin.b
        fig.update_layout(title_text=self.title, legend_y=1 + 52 / plot_px, margin_t=fig.layout.margin.t - 16)
        fig = replay_figure(fig, self.recorder.frames, max_frames=max_frames or self.max_frames, redraw=True,
                            time_label="t", note=self.record_cost_text())
        return tidy_replay(fig, lift_px=0)

    def finish(self, show: bool = True):
        """The run is over: stop polling and build :meth:`replay` (kept as ``replay_fig``).
        ``show``: put the replay where the live widget was (the widget's output is replaced, so a
        saved notebook holds a plain figure), or, in a notebook where no widget was displayed,
        display it.  Returns the replay figure."""
        self.stop_polling()
        fig = self.replay_fig = self.replay()
        if show and (self._handle is not None or in_kernel()):
            from IPython.display import display

            if self._handle is not None:
                # a plotly figure displayed through IPython makes a new output (its _ipython_display_):
                # the handle needs the figure's mime bundle to replace the live view in place
                import plotly.io as pio

                self._handle.update(pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict()), raw=True)
                for w in (self.widget, self.label, self.fig):   # their views are gone: free the models too
                    if w is not None:
                        w.close()
            else:
                display(fig)
        return fig

    def _fit(self, now: float, force: bool = False) -> None:
        """Ask the browser to size the figure to its cell again (at most every ``FIT_EVERY_S``).

        A FigureWidget is laid out once, when its view is created; inside a VBox that is often
        before the cell has a width, and the figure stays at plotly's default 700 px, narrower
        than the cell.  A relayout with ``autosize`` measures the cell again.  It has to arrive
        after the view exists, which the kernel cannot tell while a run blocks it, so it goes
        with the redraws.  Plotly has no public call for a relayout that changes no value, hence
        ``_send_relayout_msg`` (absent on a plain ``go.Figure``: then nothing is sent)."""
        if not force and now - self._last_fit < FIT_EVERY_S:
            return
        self._last_fit = now
        send = getattr(self.fig, "_send_relayout_msg", None)
        if send is not None:
            send({"autosize": True})

    def _status_lines(self) -> list[str]:
        """Two lines: where the run is (time, stage, TTFT P95, the guard), then the counts."""
        s = self.status
        head, counts = [], ""
        if "elapsed" in s:
            unit = "users" if s.get("mode") == "closed" else "req/s"
            head.append(f"<b>{s['elapsed']:.1f} s</b> stage <b>{html.escape(str(s['stage']))}</b> "
                        f"(target {s['target']:.3g} {unit})")
            counts = " &middot; ".join([f"sent {s['sent']}", f"ok {s.get('ok', 0)}",
                                        count_html("errors", s.get("error", 0), alert=True),
                                        count_html("rejected", s.get("rejected", 0), alert=True),
                                        f"cancelled {s.get('cancelled', 0)}", f"in flight {s['in_flight']}"])
        p95 = self.data["ttft_p95"][-1] if self.data["ttft_p95"] else None
        if p95 is not None:
            head.append(f"TTFT P95 {p95:.1f} ms")
        slo = s.get("slo") or {}
        if slo:
            color = {"closed": "#186a1e", "half_open": "#b8860b", "open": ALERT}[slo["state"]]
            state = slo["state"].replace("_", "-").upper()
            head.append(f"SLO <b style='color:{color}'>{state}</b> (trips {slo['trips']})")
        if self.metrics_error:
            head.append(f"<span style='color:{ALERT}'>{html.escape(self.metrics_error)}</span>")
        return [" &nbsp;|&nbsp; ".join(head) or "<b>waiting...</b>", counts]

    def _status_html(self) -> str:
        return status_lines_html(self._status_lines())

    def static_figure(self):
        """A plain ``go.Figure`` of everything recorded so far (safe to save in reports)."""
        import plotly.graph_objects as go

        return go.Figure(self._figure(go, self.data))


# ---- the live view as SVG (live="svg") -------------------------------------------------------------
_SVG_W, _SVG_L, _SVG_R = 1000, 58, 96          # viewBox width, left and right margins
_SVG_TITLE, _SVG_PLOT, _SVG_GAP, _SVG_AXIS = 20, 104, 12, 30
_DASH = {"dash": "7 4", "dot": "2 3"}


def _nice_step(span: float, n: int = 4) -> float:
    """A round tick step (1, 2, 2.5 or 5 x 10^k) giving about ``n`` ticks over ``span``."""
    if not span > 0:
        return 1.0
    raw = span / n
    k = 10 ** math.floor(math.log10(raw))
    return next(m * k for m in (1, 2, 2.5, 5, 10) if m * k >= raw)


def _fmt_tick(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 10 or float(v).is_integer() else f"{v:.2g}"


def svg_dashboard_html(data: dict, window_s: float, title: str, status_lines: list[str], name: str = "load-dashboard",
                       index: list[int] | None = None) -> str:
    """The dashboard's four rows (as :class:`LatencyDashboard` draws them with plotly) as one SVG,
    its status lines and a colour key above it: HTML for an output that is replaced at each redraw.
    ``data``: the dashboard's series (``SERIES``); ``index``: the samples to draw (all by default)."""
    t_all = data["t"]
    idx = list(range(len(t_all))) if index is None else index
    ts = [t_all[i] for i in idx]
    tmax = max([5.0] + [v for v in ts if v is not None])
    xstep = _nice_step(tmax, 8)
    tmax = math.ceil(tmax / xstep) * xstep
    pw = _SVG_W - _SVG_L - _SVG_R
    x = lambda v: _SVG_L + pw * v / tmax  # noqa: E731
    style = {k: st for k, _, _, st in TRACES}
    names = {k: n for k, n, _, _ in TRACES}
    rows = ((f"TTFT over the last {window_s:g} s (ms)", ("ttft_p50", "ttft_p95", "ttft_p99", "threshold")),
            (f"inter-token latency over the last {window_s:g} s (ms)", ("itl_p50", "itl_p95", "itl_p99")),
            ("load: requests", ("in_flight", "queue_len", "running", "batch_size", "rejected")),
            ("KV usage (%, left) and the SLO guard (right)", ("kv_usage", "slo_state")))
    parts, y0 = [], 0
    for r, (row_title, keys) in enumerate(rows):
        top = y0 + _SVG_TITLE
        bottom = top + _SVG_PLOT
        parts.append(f'<text x="{_SVG_L}" y="{y0 + 14}" font-size="13" fill="#333">{html.escape(row_title)}</text>')
        if r == 3:
            ymax, ystep = 100.0, 25.0
        else:
            vmax = max([data[k][i] for k in keys for i in idx if data[k][i] is not None], default=0.0)
            ystep = _nice_step(max(vmax * 1.08, 1.0), 3)
            ymax = max(ystep, math.ceil(max(vmax * 1.08, 1.0) / ystep) * ystep)
        y = lambda v, b=bottom, m=ymax: b - _SVG_PLOT * min(v, m) / m  # noqa: E731
        parts.append(f'<rect x="{_SVG_L}" y="{top}" width="{pw}" height="{_SVG_PLOT}" fill="#f4f6fa"/>')
        v = 0.0
        while v <= ymax + 1e-9:
            parts.append(f'<line x1="{_SVG_L}" x2="{_SVG_L + pw}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#fff" '
                         f'stroke-width="1.5"/><text x="{_SVG_L - 6}" y="{y(v) + 4:.1f}" font-size="11" '
                         f'text-anchor="end" fill="#555">{_fmt_tick(v)}</text>')
            v += ystep
        if r == 3:                                   # the guard's states on the right
            for level, label in ((0, "closed"), (1, "half-open"), (2, "open")):
                parts.append(f'<text x="{_SVG_L + pw + 6}" y="{y(level * 50) + 4:.1f}" font-size="11" '
                             f'fill="#555">{label}</text>')
        xv = 0.0
        while xv <= tmax + 1e-9:
            parts.append(f'<line x1="{x(xv):.1f}" x2="{x(xv):.1f}" y1="{top}" y2="{bottom}" stroke="#fff"/>')
            if r == 3:
                parts.append(f'<text x="{x(xv):.1f}" y="{bottom + 15}" font-size="11" text-anchor="middle" '
                             f'fill="#555">{_fmt_tick(xv)}</text>')
            xv += xstep
        for k in keys:
            st = style[k]
            dash = f' stroke-dasharray="{_DASH[st["dash"]]}"' if st.get("dash") in _DASH else ""
            seg: list[str] = []
            segs = [seg]
            prev = None
            for i in idx:
                tv, val = t_all[i], data[k][i]
                if tv is None or val is None:
                    seg = []
                    segs.append(seg)
                    prev = None
                    continue
                val = val * 50 if k == "slo_state" else val
                if k == "slo_state" and prev is not None:      # a step: hold the previous level until now
                    seg.append(f"{x(tv):.1f},{y(prev):.1f}")
                seg.append(f"{x(tv):.1f},{y(val):.1f}")
                prev = val
            for sg in segs:
                if len(sg) >= 1:
                    pts = sg if len(sg) > 1 else sg + sg
                    parts.append(f'<polyline points="{" ".join(pts)}" fill="none" stroke="{st["color"]}" '
                                 f'stroke-width="{2.5 if k == "slo_state" else 1.8}"{dash}>'
                                 f'<title>{html.escape(HOVER.get(k, names[k]))}</title></polyline>')
        y0 = bottom + _SVG_GAP + (_SVG_AXIS if r == 3 else 0)
    parts.append(f'<text x="{_SVG_L + pw / 2}" y="{y0 - 2}" font-size="12" text-anchor="middle" fill="#333">'
                 'seconds since the start</text>')
    svg = (f'<svg viewBox="0 0 {_SVG_W} {y0 + 4}" width="100%" style="max-width:{_SVG_W}px;font-family:sans-serif" '
           f'role="img">{"".join(parts)}</svg>')
    key = []
    for _, label, _, st in TRACES:
        if label.startswith("ITL"):
            continue                                 # one entry per percentile: the colour of both latency rows
        dash = f' stroke-dasharray="{_DASH[st["dash"]]}"' if st.get("dash") in _DASH else ""
        key.append(f'<span style="white-space:nowrap;margin-right:12px"><svg width="22" height="8">'
                   f'<line x1="0" x2="22" y1="4" y2="4" stroke="{st["color"]}" stroke-width="2.5"{dash}/></svg> '
                   f'{html.escape(label)}</span>')
    legend = (f'<div style="font:12px sans-serif;color:#333;margin:2px 0 4px {_SVG_L * 0.8:.0f}px;'
              f'display:flex;flex-wrap:wrap">{"".join(key)}</div>')
    head = (f'<div style="font:15px sans-serif;color:#222;margin:4px 0">{html.escape(title)} '
            f'<span style="font-size:12px;color:#777">(live: redrawn a few times a second)</span></div>')
    return (f'<div class="wb-live wb-live-{html.escape(name)} wb-live-svg" style="max-width:{_SVG_W}px">{head}'
            f'<div style="font:13px sans-serif">{status_lines_html(status_lines)}</div>{legend}{svg}</div>')




def latency_vs_load_figure(df, x: str = "offered_qps", ys=("ttft_p50_ms", "ttft_p95_ms"),
                           group: str | None = "window_ms", title: str = "TTFT vs offered load"):
    """Static figure for a sweep table: ``x`` (offered QPS) against each ``ys`` column (P50 solid,
    P95 dashed, ...), one colour per value of ``group`` (for example the micro-batch window).
    ``df``: one row per (setting, load) - e.g. the ``all`` rows of LoadResult.summary() with a
    ``window_ms`` column added."""
    import plotly.graph_objects as go

    missing = [c for c in (x, *ys, *([group] if group else [])) if c not in df.columns]
    if missing:
        raise ConfigError(f"latency_vs_load_figure: column(s) {missing} not in the table; it has {list(df.columns)}")
    groups = [(None, df)] if group is None else list(df.groupby(group, sort=True))
    dashes = ("solid", "dash", "dot", "dashdot")
    fig = go.Figure()
    for gi, (gval, sub) in enumerate(groups):
        sub = sub.sort_values(x)
        color = f"hsl({(gi * 137) % 360},60%,45%)"
        for yi, y in enumerate(ys):
            label = y.replace("_ms", "").replace("_", " ").upper()
            name = label if gval is None else f"{group}={gval}: {label}"
            fig.add_trace(go.Scatter(x=sub[x], y=sub[y], mode="lines+markers", name=name,
                                     line=dict(color=color, dash=dashes[yi % len(dashes)]),
                                     hovertemplate=f"{name}<br>{x}=%{{x:.3g}}: %{{y:.1f}} ms<extra></extra>"))
    fig.update_layout(title=title, xaxis_title=x.replace("_", " "), yaxis_title="ms", yaxis_rangemode="tozero",
                      height=400, margin=dict(l=60, r=20, t=50, b=40))
    return fig
