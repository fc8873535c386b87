"""Live and static views of a load run (plotly / ipywidgets imported lazily, inside).

* :class:`LatencyDashboard` - a FigureWidget with four rows, live while a run goes:
  TTFT P50/P95/P99 over a rolling window (and the SLO guard's threshold); inter-token
  latency P50/P95/P99 over the same window (gaps of finished requests); load: requests in
  flight (client side), queue length / running / batch size (when the target exposes them)
  and requests rejected so far; KV usage and the SLO guard's state.  Redrawn at most
  ``max_hz`` times a second inside ``batch_update()``; ``static_figure()`` for reports
  (a saved FigureWidget's state is stale).  One horizontal legend above the rows (one entry
  per percentile for both latency rows), so the plots keep the cell's width; the status line
  above the figure has a fixed height (two lines that never wrap), so the figure does not move
  while the run goes.
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
from workbench.lab.sched_timeline import TIMELINE_COLUMNS, scheduler_timeline  # noqa: F401  (re-exported)
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
    default (a virtual-time run passes its loop's ``loop.time``).  The displayed VBox carries the
    CSS classes ``wb-live`` and ``wb-live-<name>`` (for a browser run to find it).
    """

    def __init__(self, window_s: float = 10.0, max_hz: float = 10.0, metrics_fn: Callable[[], dict] | None = None,
                 metrics_hz: float = 3.0, guard=None, title: str = "Load (live)", height: int = 820,
                 clock: Callable[[], float] = time.monotonic, name: str = "load-dashboard") -> None:
        import ipywidgets as widgets
        import plotly.graph_objects as go

        if not 0 < max_hz <= 10:
            raise ConfigError(f"LatencyDashboard: max_hz={max_hz!r} must be in (0, 10]")
        if not 0 < metrics_hz <= 10:
            raise ConfigError(f"LatencyDashboard: metrics_hz={metrics_hz!r} must be in (0, 10]")
        if not window_s > 0:
            raise ConfigError(f"LatencyDashboard: window_s={window_s!r} must be > 0 seconds")
        self.window_s, self.min_interval, self.metrics_interval = window_s, 1.0 / max_hz, 1.0 / metrics_hz
        self.metrics_fn, self.guard, self.title, self.height = metrics_fn, guard, title, height
        self.clock = clock                      # paces redraws (max_hz) and inline polls: the run's clock
        self.fig = go.FigureWidget(self._figure(go))
        # a fixed-height status label: the figure below it never moves when the text changes
        self.label = widgets.HTML(value=status_lines_html(["<b>waiting for the run to start...</b>", ""]),
                                  layout=widgets.Layout(height=f"{2 * STATUS_LINE_PX}px", width="100%",
                                                        overflow="hidden"))
        self.label.add_class("wb-status")
        self.widget = widgets.VBox([self.label, self.fig])
        self.widget.add_class("wb-live")
        self.widget.add_class(f"wb-live-{name}")
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
        return self.widget._repr_mimebundle_(**kwargs)

    def display(self) -> LatencyDashboard:
        from IPython.display import display
        display(self.widget)
        return self

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
        c = run.counts
        self.status = {"elapsed": run.elapsed(), "stage": run.stage_name, "target": run.target_value(),
                       "mode": run.config.mode, "sent": run.sent, **c, "in_flight": run.in_flight}
        self.update(t=run.elapsed(), record=record, in_flight=run.in_flight, rejected=c.get("rejected", 0),
                    force=run.done)
        if run.done:
            self.stop_polling()
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
        self._redraw()
        self._fit(now, force=force)
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

    def _redraw(self) -> None:
        t0 = time.monotonic()
        self.redraws += 1
        with self.fig.batch_update():
            for tr, (k, *_) in zip(self.fig.data, TRACES):
                tr.x, tr.y = self.data["t"], self.data[k]
        self.label.value = self._status_html()
        self.redraw_seconds += time.monotonic() - t0

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
