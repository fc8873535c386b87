"""Notebook 06's views (end to end): which layer buys what.

The numbers come from :class:`workbench.bench.end_to_end.Ablation` (its ``waterfall`` steps and
``summary`` table); this module only draws them (plotly imported inside the functions)::

    waterfall_figure(ab.waterfall("ttft_ms_p95"), metric="TTFT p95", unit="ms")
    ablation_figure(ab.summary(), "ttft_ms_p95")      # each layer alone against the baseline
    memory_figure(ab.summary())                       # KV and weight bytes per configuration

**The waterfall.** The stack's first bar is the baseline; each layer added is a floating bar from
the previous step's median to its own: green when the comparison with the previous step says it
is better, red when worse, grey and hatched when the change is within noise (the runs' ranges
overlap, or the ratio is below the noise floor).  Behind each step, a grey band spans the
previous median +- the noise floor: a change inside it is never a verdict.  A vertical line on
each step is the range of its runs.  A layer the engine refused on top of the stack is a cross
on the previous level, its reason in the hover.  The last bar is the whole stack against the
baseline.

**While the rounds run** (:class:`AblationLive`): the waterfall so far (:func:`waterfall_html`) and a
table of the configurations measured so far, one display handle of plain HTML replaced in place after
every run (no widget: a saved notebook keeps the last state), and a recording of every run
(:mod:`workbench.lab.replay`) that :meth:`AblationLive.replay` turns into a figure with frames,
play / pause and a scrubber.

**Controls over measured results** (:func:`slo_explorer_figure`): plotly's own slider and dropdown
(no kernel needed, so they work in a saved notebook and in the HTML report): the SLO bound moves
over precomputed recommendations (:func:`slo_choices`), the metric dropdown swaps the waterfall.

Colours are colour-blind safe (Okabe-Ito): better bluish green, worse vermillion, within noise grey
and hatched; every coloured chart carries its key.
"""

from __future__ import annotations

import html
import math
import time
from collections.abc import Callable

from workbench.lab.live_output import in_kernel

BETTER, WORSE, NOISE, BASE, SKIP = "#009E73", "#D55E00", "#bab0ac", "#0072B2", "#7f7f7f"
PENDING = "#e6e6e6"                       # a stack step not measured yet (the live waterfall)
MEETS, MISSES, QUALITY, PICK = "#0072B2", "#E69F00", "#999999", "#009E73"   # the SLO panel
RECOMMENDATION_PREFIX = "recommendation:"   # the SLO explorer's annotation starts with it (a DOM hook)
SLO_META = "wb-slo-explorer"                 # the SLO explorer's layout.meta (a DOM hook: gd.layout.meta)


def _fmt(v: float, unit: str) -> str:
    a = abs(v)
    s = f"{v:.3g}" if a < 10 else f"{v:.1f}" if a < 1000 else f"{v:,.0f}"
    return f"{s} {unit}".strip()


def _wrap(text: str, width: int = 70) -> str:
    import textwrap

    return "<br>".join(textwrap.wrap(html.escape(str(text)), width)) if text else ""


def step_color(step: dict, lower_is_better: bool = True) -> str:
    """The bar colour of one waterfall step (see the module docstring)."""
    kind = step["kind"]
    if kind == "start":
        return BASE
    if kind == "skipped":
        return SKIP
    if kind == "pending":
        return PENDING
    if step.get("within_noise", True) or step.get("winner") is None:
        return NOISE
    improved = step["delta"] < 0 if lower_is_better else step["delta"] > 0
    return BETTER if improved else WORSE


def _waterfall_parts(steps: list[dict], metric: str, unit: str, lower_is_better: bool, xref: str = "x",
                     yref: str = "y") -> tuple[list, list[dict], list[str]]:
    """The waterfall's traces (the bars first, then the runs' ranges and the skipped layers' crosses),
    its shapes (noise bands, connectors) on axes ``xref`` / ``yref``, and the x labels."""
    import plotly.graph_objects as go

    xs = [("+" if s["kind"] in ("step", "skipped", "pending") else "") + s["label"] for s in steps]
    base, height_, colors, patterns, texts, hovers = [], [], [], [], [], []
    level = None
    for s in steps:
        kind = s["kind"]
        if kind in ("skipped", "pending"):
            base.append(level or 0.0)
            height_.append(0.0)
            texts.append("not in the stack" if kind == "skipped" else "not measured yet")
            hovers.append(f"<b>{html.escape(s['label'])}</b>: not in the stack<br>{_wrap(s.get('reason'))}"
                          if kind == "skipped" else f"<b>{html.escape(s['label'])}</b>: not measured yet")
        elif kind == "start":
            base.append(0.0)
            height_.append(s["value"])
            texts.append(_fmt(s["value"], unit))
            hovers.append(f"<b>baseline</b>: {_fmt(s['value'], unit)} (median; runs {_fmt(s['lo'], unit)}.."
                          f"{_fmt(s['hi'], unit)})")
            level = s["value"]
        else:
            lo, hi = sorted((s["prev"], s["value"]))
            base.append(0.0 if kind == "total" else lo)
            height_.append(s["value"] if kind == "total" else hi - lo)
            rel = f"{100 * s['rel']:+.0f} %" if s.get("rel") is not None else ""
            texts.append(f"{rel} (within noise)" if s.get("within_noise") else rel)
            hovers.append(f"<b>{html.escape(s['label'])}</b>: {_fmt(s['prev'], unit)} -> {_fmt(s['value'], unit)} "
                          f"({rel})<br>{_wrap(s.get('verdict'))}<br>noise floor {s.get('noise', 0):.0%}"
                          + (f"<br>{html.escape(s['config'])}" if s.get("config") else ""))
            if kind == "step":
                level = s["value"]
        colors.append(step_color(s, lower_is_better))
        patterns.append("/" if s["kind"] in ("step", "total") and s.get("within_noise") else "")
    # (plotly.js logs "Invalid color specifier" in the console for a pattern over per-bar colours; harmless)
    traces = [go.Bar(x=xs, y=height_, base=base, marker={"color": colors, "line": {"width": 0, "color": "black"},
                                                          "pattern": {"shape": patterns, "fgcolor": "#666666"}},
                     text=texts, textposition="outside", hovertext=hovers, hoverinfo="text", name=metric,
                     showlegend=False, cliponaxis=False)]
    # the runs' range of each measured step, the skipped layers as crosses on the level they left
    rx, ry, rlo, rhi = [], [], [], []
    for x, s in zip(xs, steps):
        if s["kind"] in ("start", "step") and "lo" in s:
            rx.append(x)
            ry.append(s["value"])
            rlo.append(s["value"] - s["lo"])
            rhi.append(s["hi"] - s["value"])
    traces.append(go.Scatter(x=rx, y=ry, mode="markers", marker={"color": "black", "size": 5}, name="runs (min..max)",
                             error_y={"type": "data", "symmetric": False, "array": rhi, "arrayminus": rlo,
                                      "thickness": 1.2, "width": 4},
                             hoverinfo="skip"))
    sk = [(x, b) for x, b, s in zip(xs, base, steps) if s["kind"] == "skipped"]
    if sk:
        traces.append(go.Scatter(x=[x for x, _ in sk], y=[b for _, b in sk], mode="markers", name="not in the stack",
                                 marker={"symbol": "x", "size": 11, "color": SKIP}, hoverinfo="skip"))
    # noise bands behind the steps, connectors between consecutive levels
    shapes = []
    for i, s in enumerate(steps):
        if s["kind"] == "step" and s.get("noise") is not None:
            shapes.append(dict(type="rect", xref=xref, yref=yref, x0=i - 0.45, x1=i + 0.45,
                               y0=s["prev"] * (1 - s["noise"]), y1=s["prev"] * (1 + s["noise"]),
                               fillcolor="rgba(128,128,128,0.18)", line={"width": 0}, layer="below"))
    ends, level = [], None
    for s in steps:
        level = s["value"] if s["kind"] in ("start", "step", "total") else level
        ends.append(level)
    for i in range(len(steps) - 1):
        if ends[i] is not None and steps[i + 1]["kind"] != "total":
            shapes.append(dict(type="line", xref=xref, yref=yref, x0=i + 0.4, x1=i + 0.6, y0=ends[i], y1=ends[i],
                               line={"color": "#888", "width": 1, "dash": "dot"}))
    return traces, shapes, xs


def _verdict_key(legend: str | None = None, hatched: bool = True) -> list:
    """The colour key of verdict-coloured bars: legend-only entries (no data); ``hatched``: the
    within-noise bars are hatched (the waterfall) or plain grey."""
    import plotly.graph_objects as go

    kw = {"legend": legend} if legend else {}
    return [go.Bar(x=[None], y=[None], marker_color=BASE, name="baseline", **kw),
            go.Bar(x=[None], y=[None], marker_color=BETTER, name="better (beyond noise)", **kw),
            go.Bar(x=[None], y=[None], marker_color=WORSE, name="worse (beyond noise)", **kw),
            go.Bar(x=[None], y=[None], marker={"color": NOISE, "pattern_shape": "/" if hatched else ""},
                   name="within noise", **kw)]


def waterfall_figure(steps: list[dict], metric: str = "TTFT p95", unit: str = "ms", lower_is_better: bool = True,
                     title: str | None = None, height: int = 460):
    """The stack as a waterfall of one metric (``steps``: :meth:`Ablation.waterfall`; a step of kind
    ``pending`` - a configuration not measured yet, while the rounds run - is an empty slot)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    traces, shapes, _ = _waterfall_parts(steps, metric, unit, lower_is_better)
    for t in traces:
        fig.add_trace(t)
    for sh in shapes:
        fig.add_shape(**sh)
    for t in _verdict_key()[1:]:
        fig.add_trace(t)
    # the colour key sits above the plot, right-aligned: it covers no bar and no tick label
    fig.update_layout(title=title or f"Which layer buys what: {metric} as layers are added (median of the runs)",
                      yaxis_title=f"{metric} ({unit})" if unit else metric, barmode="overlay", height=height,
                      margin={"l": 60, "r": 20, "t": 90, "b": 110},
                      legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0, "yanchor": "bottom",
                              "font": {"size": 11}, "bgcolor": "rgba(0,0,0,0)"})
    return fig


def ablation_figure(summary, metric: str = "ttft_ms_p95", label: str = "TTFT p95", unit: str = "ms",
                    verdict_column: str | None = None, height: int = 480):
    """Each configuration's median ``metric`` (``summary``: :meth:`Ablation.summary`), the
    baseline's as a dashed line, bars coloured by their verdict against the baseline."""
    import plotly.graph_objects as go

    verdict_column = verdict_column or f"vs baseline: {label}"
    df = summary.reset_index()
    base = float(df.loc[df["config"] == "baseline", metric].iloc[0])
    colors, texts = [], []
    for _, r in df.iterrows():
        v = str(r.get(verdict_column, "-"))
        if r["config"] == "baseline":
            colors.append(BASE)
        elif v.startswith("within noise") or v == "-":
            colors.append(NOISE)
        else:
            colors.append(BETTER if not v.startswith("baseline") else WORSE)
        texts.append(v if r["config"] != "baseline" else "baseline")
    fig = go.Figure(go.Bar(x=[short_name(c) for c in df["config"]], y=df[metric], marker_color=colors,
                           hovertext=[f"{html.escape(c)}: {html.escape(t)}" for c, t in zip(df["config"], texts)],
                           hoverinfo="text+y", name=label, showlegend=False))
    for t in _verdict_key(hatched=False):
        fig.add_trace(t)
    fig.add_hline(y=base, line_dash="dash", line_color=BASE, annotation_text="baseline")
    fig.update_layout(title=f"{label} per configuration (median of the runs; colour: verdict against the baseline)",
                      yaxis_title=f"{label} ({unit})", height=height, margin={"l": 60, "r": 20, "t": 90, "b": 160},
                      legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0, "yanchor": "bottom",
                              "font": {"size": 11}, "bgcolor": "rgba(0,0,0,0)"})
    return fig


_TOP_LEGEND = {"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0, "yanchor": "bottom", "font": {"size": 11},
               "bgcolor": "rgba(0,0,0,0)"}


def memory_figure(summary, height: int = 480):
    """KV bytes held and weight bytes per configuration, stacked (MiB)."""
    import plotly.graph_objects as go

    df = summary.reset_index()
    xs = [short_name(c) for c in df["config"]]
    fig = go.Figure()
    fig.add_bar(x=xs, y=df["weights_bytes"] / 2**20, name="weights", marker_color="#9d755d")
    fig.add_bar(x=xs, y=df["kv_bytes"] / 2**20, name="KV held", marker_color="#72b7b2")
    if "kv_used_bytes" in df:
        fig.add_scatter(x=xs, y=(df["weights_bytes"] + df["kv_used_bytes"]) / 2**20, mode="markers",
                        name="weights + KV in use at the peak (full precision)",
                        marker={"symbol": "line-ew-open", "size": 18, "color": "black"})
    fig.update_layout(barmode="stack", title="Measured memory per configuration", yaxis_title="MiB", height=height,
                      margin={"l": 60, "r": 20, "t": 90, "b": 160}, legend=_TOP_LEGEND)
    return fig


BREAKDOWN = (("static_step_ms", "static decode step (compiled)", "#72b7b2"), ("matmul_ms", "matmul", "#4c78a8"),
             ("attention_ms", "attention", "#f58518"),
             ("gather_ms", "gather / scatter of KV", "#e45756"), ("other_model_ms", "other model time", "#bab0ac"),
             ("scheduling_ms", "scheduling", "#54a24b"), ("output_ms", "output", "#b279a2"))


def breakdown_figure(df, height: int = 420):
    """Where each configuration's replay time goes (``df``: :func:`workbench.bench.e2e_breakdown.breakdown`),
    stacked per configuration (ms of one profiled replay)."""
    import plotly.graph_objects as go

    d = df.reset_index()
    xs = [short_name(c) for c in d["config"]]
    fig = go.Figure()
    for col, name, color in BREAKDOWN:
        if col in d:
            fig.add_bar(x=xs, y=d[col], name=name, marker_color=color, customdata=d["config"],
                        hovertemplate="%{customdata}: %{y:,.1f} ms<extra>" + name + "</extra>")
    # seven parts: the key under the plot, at the figure's bottom (above it, it wrapped over the title)
    fig.update_layout(barmode="stack", title="Where the time goes: one profiled replay per configuration",
                      yaxis_title="ms (profiled replay)", height=height + 60,
                      margin={"l": 60, "r": 20, "t": 60, "b": 190},
                      legend={"orientation": "h", "yref": "container", "y": 0, "yanchor": "bottom", "x": 0,
                              "xanchor": "left", "font": {"size": 11}})
    return fig


def waterfall_html(steps: list[dict], unit: str = "ms", lower_is_better: bool = True, width_px: int = 400) -> str:
    """The waterfall as plain HTML (no script: it redraws on every update of a display handle, and a
    saved notebook keeps it): one row per step, its bar spanning the previous level to its own on a
    shared scale, coloured and hatched as :func:`waterfall_figure`; a step not measured yet says so."""
    vals = [v for s in steps for v in (s.get("value"), s.get("prev")) if isinstance(v, (int, float))]
    top = 1.05 * max(vals) if vals and max(vals) > 0 else 1.0
    key = "".join(f'<span style="display:inline-block;width:11px;height:11px;background:{bg};margin:0 4px 0 12px;'
                  f'vertical-align:middle"></span>{html.escape(name)}'
                  for bg, name in ((BASE, "baseline"), (BETTER, "better (beyond noise)"),
                                   (WORSE, "worse (beyond noise)"),
                                   (f"repeating-linear-gradient(45deg,{NOISE},{NOISE} 3px,#fff 3px,#fff 5px)",
                                    "within noise")))
    rows = []
    for s in steps:
        kind = s["kind"]
        label = ("+" if kind in ("step", "skipped", "pending") else "") + s["label"]
        color = step_color(s, lower_is_better)
        bar, text = "", ""
        if kind in ("start", "step", "total"):
            lo, hi = (0.0, s["value"]) if kind in ("start", "total") else sorted((s["prev"], s["value"]))
            bg = (f"repeating-linear-gradient(45deg,{color},{color} 3px,#fff 3px,#fff 5px)"
                  if s.get("within_noise") and kind != "start" else color)
            bar = (f'<div style="position:absolute;left:{lo / top * width_px:.0f}px;top:2px;height:14px;'
                   f'width:{max(2.0, (hi - lo) / top * width_px):.0f}px;background:{bg}"></div>')
            rel = f"{100 * s['rel']:+.0f} %" if s.get("rel") is not None else ""
            text = (_fmt(s["value"], unit) if kind == "start" else
                    f"{_fmt(s['value'], unit)} ({rel}{', within noise' if s.get('within_noise') else ''})")
        else:
            text = "not measured yet" if kind == "pending" else "not in the stack"
        rows.append(f'<tr><td style="text-align:right;padding:1px 8px;white-space:nowrap">{html.escape(label)}</td>'
                    f'<td style="padding:1px 0"><div style="position:relative;width:{width_px}px;height:18px;'
                    f'background:#f3f3f3">{bar}</div></td>'
                    f'<td style="text-align:left;padding:1px 8px;white-space:nowrap;color:#333">{html.escape(text)}'
                    '</td></tr>')
    return (f'<div class="wb-waterfall-html" style="font:12px sans-serif;margin:4px 0">'
            f'<div style="margin:2px 0 4px 0">{key}</div><table style="border-collapse:collapse">{"".join(rows)}'
            f'</table><div style="color:#555;margin-top:2px">each bar spans the previous step\'s median to this one\'s '
            f'(the full width: 0 to {_fmt(top, unit)})</div></div>')


# ---- readable tables -------------------------------------------------------------------------------

HEADINGS = {   # column -> heading with its unit (the saved tables keep the raw columns)
    "ttft_ms_p50": "TTFT p50 (ms)", "ttft_ms_p95": "TTFT p95 (ms)", "tpot_ms_p50": "TPOT p50 (ms)",
    "tpot_ms_p95": "TPOT p95 (ms)", "e2e_ms_p50": "E2E p50 (ms)", "e2e_ms_p95": "E2E p95 (ms)",
    "ttft_jitter_ms": "TTFT jitter (ms)", "tpot_jitter_ms": "TPOT jitter (ms)",
    "ttft_ms_p95_chat": "TTFT p95 chat (ms)", "ttft_ms_p95_doc": "TTFT p95 doc (ms)",
    "ttft_ms_p95_short": "TTFT p95 short (ms)", "tokens_per_s": "tokens/s",
    "prefix_hit_rate": "prefix hits", "preemptions": "preemptions", "kv_bytes": "KV held", "kv_used_bytes": "KV in use",
    "weights_bytes": "weights", "rss_bytes": "process RSS", "device_peak_bytes": "device peak",
    "memory_bytes": "memory (KV + weights)", "agreement": "greedy agreement", "identical": "identical tokens",
    "identical_sequences": "identical sequences", "rel_ppl": "perplexity change", "rel_ppl_se": "± s.e.",
    "kl": "KL (nats)", "top1_agreement": "top-1 agreement", "ttft_ms_p95_worst": "TTFT p95, slowest round (ms)",
    "ttft_ms_p95_median": "TTFT p95, median (ms)", "tokens_per_s_median": "tokens/s (median)",
    "wall_ms": "replay (ms)", "decode_step_ms_p50": "decode step p50 (ms)", "mixed_step_ms_p50": "mixed step p50 (ms)",
    "matmul_ms": "matmul (ms)", "attention_ms": "attention (ms)", "gather_ms": "KV gather (ms)",
    "other_model_ms": "other model (ms)", "scheduling_ms": "scheduling (ms)", "output_ms": "output (ms)",
    "static_step_ms": "static step (ms)", "value": "median", "prev": "previous", "delta": "change", "rel": "change (%)",
}
DASH = "—"


def fmt_bytes(v) -> str:
    """Bytes as B / KiB / MiB / GiB with three significant digits; "—" for none."""
    if v is None or isinstance(v, bool) or (isinstance(v, float) and not math.isfinite(v)):
        return DASH
    v = float(v)
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(v) >= size:
            x = v / size
            return f"{x:,.0f} {unit}" if abs(x) >= 100 else f"{x:.1f} {unit}" if abs(x) >= 10 else f"{x:.2f} {unit}"
    return f"{v:,.0f} B"


def _cell(col: str, v, unit: str = ""):
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return DASH
    if isinstance(v, bool):
        return "yes" if v else "no"
    if not isinstance(v, (int, float)):
        try:                                    # numpy scalars
            v = v.item()
        except AttributeError:
            return v
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            return _cell(col, v, unit)
    if col.endswith("_bytes"):
        return fmt_bytes(v)
    if col in ("rel_ppl", "rel_ppl_se", "rel"):
        return f"{100 * v:+.2f} %" if col != "rel_ppl_se" else f"{100 * v:.2f} %"
    if col in ("agreement", "top1_agreement", "prefix_hit_rate"):
        return f"{100 * v:.1f} %"
    if col == "kl":
        return f"{v:.2g}"
    if "tokens_per_s" in col:
        return f"{v:,.0f}"
    if "_ms" in col or col.endswith("ms") or "(ms)" in col or unit == "ms":
        return f"{v:,.1f}"
    if isinstance(v, int) or float(v).is_integer():
        return f"{int(v):,}"
    return f"{v:,.2f}" if abs(v) >= 1 else f"{v:.3g}"


def readable(df, unit: str = "", headings: bool = True):
    """A copy of ``df`` for display: ms to one decimal, bytes in KiB / MiB / GiB, rates and agreements
    in %, throughput whole, booleans yes / no, nothing missing shown as "—"; the columns get
    headings with their units (:data:`HEADINGS`).  ``unit``: the unit of columns named otherwise
    (e.g. a waterfall's ``value`` / ``prev`` / ``delta``).  The saved tables keep the raw values."""
    out = df.copy().astype(object)
    for col in df.columns:
        out[col] = [_cell(str(col), v, unit) for v in df[col]]
    if headings:
        out = out.rename(columns=lambda c: HEADINGS.get(c, c) if not unit or c not in ("value", "prev", "delta")
                         else f"{HEADINGS[c]} ({unit})")
    return out


# ---- progress --------------------------------------------------------------------------------------

def follow(bar, prefix: str = ""):
    """A ``progress(k, n, name)`` callback (what :meth:`Ablation.build`, ``warm_up``, ``breakdown``
    and ``run_claims`` call) that drives a :class:`workbench.lab.progress.Progress` ``bar``: ``k`` of
    ``n`` done, ``name`` running."""
    def step(k: int, n: int, name: str) -> None:
        bar.total = n
        if k > bar.done:
            bar.advance(k - bar.done)
        if name:
            bar.start(f"{prefix}{name}")
    return step


# ---- the rounds, live and replayed ------------------------------------------------------------------

class AblationLive:
    """Notebook 06's view of the rounds while they run, and their replay.

    ``started(r, i, c)`` and ``finished(r, c, row)`` are :meth:`Ablation.run`'s callbacks (called
    between runs, never inside a timed replay).  Each finished run is recorded as a frame of
    the rounds figure (every configuration's median of ``metric`` so far, each run as a dot, the run
    just finished marked), and drives ``bar`` (a :class:`~workbench.lab.progress.Progress`: round
    r/R, configuration k/n).  With ``show``, the waterfall so far (:func:`waterfall_html`) and a table
    of the configurations measured so far are one display handle replaced in place after every run:
    plain HTML, which JupyterLab redraws on each update (its plotly renderer draws a figure once and
    ignores updates) and a saved notebook keeps as it last was.  ``record_s`` / ``view_s``: what
    recording and the live view cost, measured."""

    def __init__(self, ab, metric: str = "ttft_ms_p95", repeats: int | None = None, show: bool = True,
                 clock=time.monotonic) -> None:
        from workbench.bench.e2e_results import METRICS
        from workbench.lab.replay import Recorder

        self.ab, self.metric, self.clock = ab, metric, clock
        self.label, self.unit, self.lower = METRICS.get(metric, (metric, "", True))
        self.repeats = repeats or ab.cfg.repeats
        self.names = [c.name for c in ab.configs]
        self.total = self.repeats * len(self.names)
        self.stack_names = {st["config"] for st in ab.stack if st.get("config")} | {"baseline"}
        self.recorder = Recorder()
        self.bar = None
        self.show = show and in_kernel()
        self.t0: float | None = None
        self.record_s = self.view_s = 0.0
        self.events = self.draws = 0
        self._handle = None
        self._round = 0

    # -- the callbacks
    def started(self, r: int, i: int, c) -> None:
        if self.t0 is None:
            self.t0 = self.clock()
        self._round = r
        if self.bar is not None:
            self.bar.start(f"round {r + 1}/{self.repeats} · configuration {i + 1}/{len(self.names)}: {c.name}")

    def finished(self, r: int, c, row: dict) -> None:
        t = self.clock()
        if self.t0 is None:
            self.t0 = t
        data, label = self.frame(r, c.name, row)
        self.recorder.add(data, label=label, t_ms=(t - self.t0) * 1e3)
        self.record_s += self.clock() - t
        self.events += 1
        if self.bar is not None:
            self.bar.advance()
        if self.show:
            t = self.clock()
            self.draw()
            self.view_s += self.clock() - t

    def finish(self) -> None:
        """The last state of the live table and waterfall (every run in)."""
        if self.show:
            t = self.clock()
            self.draw()
            self.view_s += self.clock() - t

    # -- what is drawn
    def _runs(self, name: str) -> list[float]:
        return [r[self.metric] for r in self.ab.config(name).runs if r.get(self.metric) is not None]

    def frame(self, r: int, name: str, row: dict) -> tuple[list, str]:
        """The rounds figure's traces after round ``r``'s run of ``name``: medians so far (bars),
        every run so far (dots), this run (a diamond)."""
        import numpy as np

        med, dx, dy = [], [], []
        for n in self.names:
            vals = self._runs(n)
            med.append(round(float(np.median(vals)), 1) if vals else None)
            dx += [round(float(v), 1) for v in vals]
            dy += [short_name(n)] * len(vals)
        v = row.get(self.metric)
        # each trace's type is named: plotly draws a frame's trace without one as a scatter
        data = [{"type": "bar", "x": med},                      # the bars' y (every configuration) never changes
                {"type": "scatter", "x": dx, "y": dy},
                {"type": "scatter", "x": [None if v is None else round(float(v), 1)], "y": [short_name(name)]}]
        value = "-" if v is None else _fmt(float(v), self.unit)
        return data, f"round {r + 1}/{self.repeats} · {name}: {value}"

    def table(self):
        """The configurations measured so far: runs, medians, the last run's value."""
        import numpy as np
        import pandas as pd

        rows = []
        for c in self.ab.configs:
            if not c.runs:
                continue
            med = {k: float(np.median([r[k] for r in c.runs if r.get(k) is not None]))
                   for k in ("ttft_ms_p95", "tpot_ms_p50", "e2e_ms_p95", "tokens_per_s")
                   if c.runs[0].get(k) is not None}
            rows.append({"config": c.name, "runs": len(c.runs), **med,
                         f"last run: {self.label} ({self.unit})": c.runs[-1].get(self.metric)})
        # (a column in ms gets one decimal from readable(); other units are formatted as numbers)
        df = pd.DataFrame(rows).set_index("config") if rows else pd.DataFrame()
        return readable(df) if rows else df

    def waterfall_steps(self) -> list[dict]:
        """:meth:`Ablation.waterfall` so far: a stack step with no run yet is ``pending``."""
        steps = []
        for s in self.ab.waterfall(self.metric):
            if s["kind"] == "skipped" and s.get("reason") is None:
                s = dict(s, kind="pending")
            steps.append(s)
        return steps

    def html(self) -> str:
        """The live view's HTML: the waterfall so far, then the table so far."""
        done = sum(len(c.runs) for c in self.ab.configs)
        head = (f"<b>The waterfall so far</b>: {html.escape(self.label)} (round {self._round + 1}/{self.repeats}; "
                f"{done} of {self.total} runs; medians over the runs so far)")
        wf = waterfall_html(self.waterfall_steps(), unit=self.unit, lower_is_better=self.lower)
        table = self.table()
        tab = table.to_html(escape=True) if len(table) else ""
        return (f'<div class="wb-e2e-live">{head}{wf}<div style="margin-top:8px"><b>Measured so far</b>: '
                f'per configuration</div>{tab}</div>')

    def draw(self) -> None:
        from IPython.display import HTML, display

        view = HTML(self.html())
        if self._handle is None:
            self._handle = display(view, display_id=True)
        else:
            self._handle.update(view)
        self.draws += 1

    def cost_text(self) -> str:
        """What recording and the live view cost, measured (both between runs, outside the timed replays)."""
        n = max(1, self.events)
        text = (f"recording: {self.events} runs, {self.record_s / n * 1e6:.0f} µs a run "
                f"({self.record_s * 1e3:.1f} ms in all)")
        if self.draws:
            text += (f"; live view: {self.draws} redraws, {self.view_s * 1e3:.0f} ms in all "
                     f"({self.view_s / self.draws * 1e3:.1f} ms a run)")
        return text + "; both between runs, never inside a timed replay"

    def replay(self, height: int | None = None):
        """The rounds as recorded: a figure with one frame per run, play / pause, speeds and a scrubber."""
        import plotly.graph_objects as go

        from workbench.lab.replay import replay_figure

        frames = self.recorder.frames
        top = max([v for f in frames for v in f.data[1]["x"] if v is not None] or [1.0])
        fig = go.Figure()
        fig.add_bar(x=[None] * len(self.names), y=[short_name(n) for n in self.names], orientation="h",
                    name="median so far", marker={"color": BASE}, hovertemplate="%{y}: median %{x:,.1f}<extra></extra>")
        fig.add_scatter(x=[], y=[], mode="markers", name="each run",
                        marker={"color": "black", "size": 6, "opacity": 0.6},
                        hovertemplate="%{y}: %{x:,.1f}<extra>run</extra>")
        fig.add_scatter(x=[], y=[], mode="markers", name="the run just finished",
                        marker={"color": "#E69F00", "size": 13, "symbol": "diamond",
                                "line": {"width": 1, "color": "black"}},
                        hovertemplate="%{y}: %{x:,.1f}<extra>this run</extra>")
        fig.update_layout(title=f"The rounds as they ran: {self.label} per configuration<br><sup>bar: the median "
                                "so far · dots: each run · diamond: the run that just finished</sup>",
                          showlegend=False,
                          xaxis={"title": f"{self.label} ({self.unit})", "range": [0, 1.08 * top]},
                          yaxis={"autorange": "reversed", "type": "category", "automargin": True},
                          height=height or 140 + 22 * len(self.names), margin={"l": 20, "r": 20, "t": 80, "b": 60},
                          legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1.0, "yanchor": "bottom",
                                  "font": {"size": 11}, "bgcolor": "rgba(0,0,0,0)"}, barmode="overlay")
        note = (f"recording: {self.record_s / max(1, self.events) * 1e6:.0f} µs a run"
                + (f"; live view: {self.view_s / self.draws * 1e3:.1f} ms a run" if self.draws else "")
                + " (between runs, outside the timed replays)")
        return replay_figure(fig, frames, redraw=True, time_label="t", note=note)




# ---- controls over the measured results: the SLO slider and the metric dropdown ----------------------

def _ceil1(v: float) -> float:
    return math.ceil(v * 10 - 1e-9) / 10


def slo_choices(candidates: list[dict], max_rel_ppl: float, noise: float | None = None, default: float | None = None,
                bounds=None, pick: Callable[..., str | None] | None = None) -> list[dict]:
    """The recommendation for each P95 TTFT bound a slider offers, computed now from the measured
    ``candidates`` (:meth:`Ablation.candidates`) with :func:`workbench.bench.e2e_recommend.recommend`.
    By default the bounds are where the answer can change: each configuration's slowest-round P95
    TTFT (rounded up to 0.1 ms, so it meets it), one bound under all of them (nothing meets it), and
    ``default``.  Each choice: ``bound``, ``pick`` (None: nothing meets it), ``reason``, ``meets``
    and ``quality_ok`` per configuration, ``default`` (True for the stated SLO).

    ``pick``: a stand-in for the rule's pick (notebook 06's exercise), called as
    ``pick(rows=candidates, ttft_p95_ms=bound, max_rel_ppl=..., noise=...)`` at every bound: its answer
    is the choice's ``pick`` (the reason then names the rule's when they differ).  It must name a
    measured configuration that meets the SLO at that bound, or be None: anything else is a
    WorkbenchError naming the rule."""
    from workbench.bench.e2e_recommend import SLO, recommend

    worst = sorted({max(c["ttft_ms_p95"]) for c in candidates if c["ttft_ms_p95"]})
    if bounds is None:
        bounds = {_ceil1(w) for w in worst}
        if worst:
            bounds.add(max(0.1, math.floor(0.9 * worst[0] * 10) / 10))
    bounds = set(bounds)
    if default is not None:               # the stated SLO replaces a computed bound within 0.1 ms of it
        bounds = {b for b in bounds if abs(b - float(default)) >= 0.1} | {float(default)}
    out = []
    for b in sorted(bounds):
        rec = recommend(candidates, SLO(ttft_p95_ms=b, max_rel_ppl=max_rel_ppl), noise=noise)
        if pick is not None:
            rec = _their_pick(pick, candidates, b, max_rel_ppl, noise, rec)
        out.append({"bound": b, "pick": rec["pick"], "reason": rec["reason"], "tied": rec["tied"],
                    "meets": {t["config"]: t["meets"] for t in rec["table"]},
                    "quality_ok": {t["config"]: t["rel_ppl"] is None or t["rel_ppl"] <= max_rel_ppl
                                   for t in rec["table"]},
                    "default": default is not None and b == float(default)})
    return out


def _their_pick(pick: Callable, candidates: list[dict], bound: float, max_rel_ppl: float, noise, rec: dict) -> dict:
    """``rec`` with ``pick``'s answer at ``bound`` as its pick, checked (:func:`slo_choices`)."""
    from workbench.errors import WorkbenchError

    try:
        got = pick(rows=candidates, ttft_p95_ms=bound, max_rel_ppl=max_rel_ppl, noise=noise)
    except Exception as e:  # noqa: BLE001 - the caller's code: one line, not its traceback
        raise WorkbenchError(f"slo_choices: pick raised {type(e).__name__}: {e} (P95 TTFT <= {bound:g} ms)") from None
    table = {t["config"]: t for t in rec["table"]}
    if got is not None and (not isinstance(got, str) or got not in table):
        raise WorkbenchError(f"slo_choices: pick returned {got!r} at P95 TTFT <= {bound:g} ms: the name of a measured "
                             f"configuration ({', '.join(table)}) or None")
    if got is not None and not table[got]["meets"]:
        raise WorkbenchError(f"slo_choices: pick returned {got!r} at P95 TTFT <= {bound:g} ms, which does not meet the "
                             f"SLO: {table[got]['why']}")
    if got == rec["pick"]:
        return rec
    rule = f"the rule picks {rec['pick'] or 'none'}: {rec['reason']}"
    return {**rec, "pick": got, "reason": (f"{got} meets the SLO (your pick); " if got else "your pick: none; ") + rule}


def _wrap_plain(text: str, width: int) -> str:
    import textwrap

    return "<br>".join(textwrap.wrap(html.escape(text), width))


def short_name(name: str) -> str:
    """A configuration's name for an axis: a stack step as "stack step k: +layer" (the stack's table
    numbers them), others as they are."""
    if name.startswith("stack: "):
        layers = name.removeprefix("stack: ").split(" + ")
        return f"stack step {len(layers)}: +{layers[-1]}"
    return name


def recommendation_text(choice: dict, width: int = 120) -> str:
    """The annotation of one slider position: starts with :data:`RECOMMENDATION_PREFIX`."""
    pick = choice["pick"] or "none meets this SLO"
    return (f"<b>{RECOMMENDATION_PREFIX} {html.escape(pick)}</b> (P95 TTFT ≤ {choice['bound']:,.1f} ms)<br>"
            + _wrap_plain(choice["reason"], width))


def _slo_geometry(waterfalls: dict, metrics: list[str], n_configs: int) -> tuple:
    """The explorer's pixel layout, top to bottom: title, slider, recommendation, key, dropdown |
    waterfall, its labels | key, SLO panel.  Returns (top px, bottom px, the plots' px, the waterfall's
    and the SLO panel's y domains)."""
    longest = max((len(x) for m in metrics for x in _waterfall_parts(waterfalls[m], "", "", True)[2]), default=10)
    wf_px, wf_labels_px, gap_px = 300, int(max(60, 3.6 * longest + 25)), 70     # tick labels at -30 degrees
    slo_px = max(200, 24 * n_configs + 30)
    top_px, bottom_px = 290, 60
    plot_px = wf_px + wf_labels_px + gap_px + slo_px
    return top_px, bottom_px, plot_px, (1 - wf_px / plot_px, 1.0), (0.0, slo_px / plot_px)


def _slo_annotations(fig, recommendation: str, y_top: float, y_slo: float) -> None:
    """The recommendation at the top (``layout.annotations[0]``, the slider rewrites it) and the SLO
    panel's heading."""
    fig.add_annotation(text=recommendation, xref="paper", yref="paper", x=0, y=y_top,
                       xanchor="left", yanchor="top", showarrow=False, align="left", font={"size": 13})
    fig.add_annotation(text="<b>the SLO</b>: each configuration's P95 TTFT in its slowest round (it must meet the "
                            "bound in every round), the bound dotted", xref="paper", yref="paper", x=0, y=y_slo,
                       xanchor="left", yanchor="bottom", showarrow=False, font={"size": 12})


def _slo_waterfall_traces(fig, waterfalls: dict, metrics: list[str], metric: str) -> tuple[dict, dict, list]:
    """The upper panel: each metric's waterfall (its noise bands a bar trace of their own, then its
    bars and crosses), only ``metric``'s visible.  Returns each metric's bar trace index, each
    metric's trace indices, and the steps' categories in order."""
    import plotly.graph_objects as go

    from workbench.bench.e2e_results import METRICS

    wf_bars, wf_traces, categories = {}, {}, []
    for m in metrics:
        label, unit, lower = METRICS.get(m, (m, "", True))
        traces, shapes, xs = _waterfall_parts(waterfalls[m], label, unit, lower)
        categories += [x for x in xs if x not in categories]        # the steps' order (the bands' trace comes first)
        first = len(fig.data)
        bands = [(xs[i], sh["y0"], sh["y1"] - sh["y0"]) for i, sh in enumerate(shapes) if sh["type"] == "rect"
                 for i in [round(sh["x0"] + 0.45)]]
        fig.add_trace(go.Bar(x=[b[0] for b in bands], y=[b[2] for b in bands], base=[b[1] for b in bands], width=0.9,
                             marker={"color": "rgba(128,128,128,0.18)", "line": {"width": 0}}, hoverinfo="skip",
                             name="noise floor", showlegend=False, visible=m == metric))
        for j, t in enumerate(traces):     # the visible metric's runs / crosses are in the legend
            t.update(visible=m == metric, legend="legend", showlegend=j > 0)
            fig.add_trace(t)
        wf_bars[m] = first + 1
        wf_traces[m] = list(range(first, len(fig.data)))
    return wf_bars, wf_traces, categories


def _slo_colors(choice: dict, names: list[str]) -> list[str]:
    """The SLO panel's bar colours at one slider position: the pick, meets, misses quality, too slow."""
    return [PICK if n == choice["pick"] else MEETS if choice["meets"].get(n)
            else QUALITY if not choice["quality_ok"].get(n, True) else MISSES for n in names]


def _slo_outline(choice: dict, names: list[str]) -> list[int]:
    """The SLO panel's outline widths: the pick outlined."""
    return [3 if n == choice["pick"] else 0 for n in names]


def _waterfall_outline(steps: list[dict], choice: dict) -> list[int]:
    """A waterfall's outline widths: the pick's bar outlined when it is a step of the stack."""
    return [3 if s.get("config") == choice["pick"] and s["kind"] in ("step", "start", "total") else 0
            for s in steps]


def _slo_panel_traces(fig, names: list[str], worst: list[float], ys: list[str], choice: dict,
                      max_rel_ppl: float | None) -> None:
    """The lower panel: slowest-round P95 TTFT per configuration, coloured and outlined for ``choice``,
    and its key (the bound line, recommended, meets, too slow, misses the quality bound)."""
    import plotly.graph_objects as go

    fig.add_trace(go.Bar(x=worst, y=ys, orientation="h", xaxis="x2", yaxis="y2",
                         marker={"color": _slo_colors(choice, names),
                                 "line": {"width": _slo_outline(choice, names), "color": "black"}},
                         showlegend=False, name="slowest round", customdata=names,
                         hovertemplate="%{customdata}: P95 TTFT %{x:,.1f} ms in its slowest round<extra></extra>"))
    for t in (go.Scatter(x=[None], y=[None], mode="lines", line={"color": "black", "dash": "dot", "width": 2},
                         name="the SLO bound"),
              go.Bar(x=[None], y=[None], marker={"color": PICK, "line": {"width": 3, "color": "black"}},
                     name="recommended (outlined)"),
              go.Bar(x=[None], y=[None], marker_color=MEETS, name="meets the SLO"),
              go.Bar(x=[None], y=[None], marker_color=MISSES, name="too slow"),
              go.Bar(x=[None], y=[None], marker_color=QUALITY, name="misses the quality bound"
                     + ("" if max_rel_ppl is None else f" (ppl +{100 * max_rel_ppl:g} %)"))):
        t.update(xaxis="x2", yaxis="y2", legend="legend2")
        fig.add_trace(t)


def _metric_buttons(metrics: list[str], wf_traces: dict, n_wf: int, n_traces: int) -> list[dict]:
    """The metric dropdown's buttons: each shows its metric's waterfall traces (and every trace after
    the waterfalls) and retitles the upper axis."""
    from workbench.bench.e2e_results import METRICS

    buttons = []
    for m in metrics:
        label, unit, _ = METRICS.get(m, (m, "", True))
        vis = [i in wf_traces[m] or i >= n_wf for i in range(n_traces)]
        buttons.append({"method": "update", "label": f"{label} ({unit})",
                        "args": [{"visible": vis}, {"yaxis.title.text": f"{label} ({unit})"}]})
    return buttons


def slo_explorer_figure(waterfalls: dict, choices: list[dict], candidates: list[dict], metric: str = "ttft_ms_p95",
                        max_rel_ppl: float | None = None, title: str | None = None):
    """One figure, two controls, no kernel needed (plotly's own slider and dropdown: they work in a
    saved notebook and in the HTML report):

    * the **SLO slider** moves the P95 TTFT bound over ``choices`` (:func:`slo_choices`, one step
      each, starting at the stated SLO): the annotation at the top (``layout.annotations[0]``; it
      starts with ``recommendation:``) names the pick and the rule's reason; the lower panel colours
      each configuration's slowest-round P95 TTFT by whether it meets the bound (the dotted line,
      ``layout.shapes[0]``), the pick outlined; the waterfall outlines the pick's bar when it is a step
      of the stack;
    * the **metric dropdown** swaps the upper panel's waterfall (``waterfalls``: metric ->
      :meth:`Ablation.waterfall` steps; labels from :data:`workbench.bench.e2e_results.METRICS`);
      each metric's noise bands are a bar trace of its own, so the dropdown only toggles traces.

    A step restyles only colours and outline widths (and moves the line): the figure stays small.
    ``layout.meta`` is :data:`SLO_META` (a hook for browser tests)."""
    import plotly.graph_objects as go

    from workbench.bench.e2e_results import METRICS

    metrics = [m for m in waterfalls if waterfalls[m]]
    metric = metric if metric in metrics else metrics[0]
    names = [c["name"] for c in sorted(candidates, key=lambda c: max(c["ttft_ms_p95"]))]
    worst = {c["name"]: max(c["ttft_ms_p95"]) for c in candidates}
    ys = [short_name(n) for n in names]
    active = next((i for i, c in enumerate(choices) if c["default"]), len(choices) - 1)

    top_px, bottom_px, plot_px, y_wf, y_slo = _slo_geometry(waterfalls, metrics, len(names))
    height = top_px + plot_px + bottom_px

    fig = go.Figure()
    wf_bars, wf_traces, categories = _slo_waterfall_traces(fig, waterfalls, metrics, metric)
    n_wf = len(fig.data)
    for t in _verdict_key("legend"):
        fig.add_trace(t)
    ch = choices[active]
    slo_bar = len(fig.data)
    _slo_panel_traces(fig, names, [worst[n] for n in names], ys, ch, max_rel_ppl)
    bound_line = dict(type="line", xref="x2", yref="y2 domain", x0=ch["bound"], x1=ch["bound"], y0=0, y1=1,
                      line={"color": "black", "dash": "dot", "width": 2})

    # the slider: every step recolours and outlines (the waterfall bars, the SLO panel) and moves the line
    idx = [wf_bars[m] for m in metrics] + [slo_bar]

    def step(choice):
        data = {"marker.color": [list(fig.data[wf_bars[m]].marker.color) for m in metrics]
                + [_slo_colors(choice, names)],
                "marker.line.width": [_waterfall_outline(waterfalls[m], choice) for m in metrics]
                + [_slo_outline(choice, names)]}
        return {"method": "update", "label": f"{choice['bound']:,.1f} ms" + (" (stated)" if choice["default"] else ""),
                "args": [data, {"annotations[0].text": recommendation_text(choice), "shapes[0].x0": choice["bound"],
                                "shapes[0].x1": choice["bound"]}, idx]}

    px = lambda p: p / plot_px                                                # noqa: E731 - px -> paper
    _slo_annotations(fig, recommendation_text(ch), y_top=1 + px(top_px - 130), y_slo=y_slo[1] + px(6))
    label0, unit0, _ = METRICS.get(metric, (metric, "", True))
    buttons = _metric_buttons(metrics, wf_traces, n_wf, len(fig.data))
    fig.update_layout(
        meta=SLO_META, height=height, barmode="overlay", template="plotly_white",
        title={"text": title or "Pick a configuration for an SLO: move the bound, change the waterfall's metric",
               "x": 0, "xanchor": "left", "y": 1 - 8 / height, "yanchor": "top"},
        margin={"l": 20, "r": 20, "t": top_px, "b": bottom_px},
        xaxis={"domain": [0, 1], "anchor": "y", "type": "category", "categoryorder": "array",
               "categoryarray": categories, "automargin": False, "tickangle": -30},
        yaxis={"domain": list(y_wf), "anchor": "x", "title": {"text": f"{label0} ({unit0})"}, "automargin": True},
        xaxis2={"domain": [0.36, 1], "anchor": "y2", "title": {"text": "P95 TTFT in the slowest round (ms)"},
                "rangemode": "tozero"},
        yaxis2={"domain": list(y_slo), "anchor": "x2", "type": "category", "autorange": "reversed", "automargin": False,
                "ticks": ""},
        shapes=[bound_line],
        legend={"orientation": "h", "x": 1, "xanchor": "right", "y": 1 + px(50), "yanchor": "bottom",
                "font": {"size": 11}, "bgcolor": "rgba(0,0,0,0)"},                 # above the dropdown's row
        legend2={"orientation": "h", "x": 1, "xanchor": "right", "y": y_slo[1] + px(26), "yanchor": "bottom",
                 "font": {"size": 11}, "bgcolor": "rgba(0,0,0,0)"},
        updatemenus=[{"type": "dropdown", "buttons": buttons, "active": metrics.index(metric), "x": 0,
                      "xanchor": "left", "y": 1 + px(6), "yanchor": "bottom", "showactive": True,
                      "pad": {"r": 4, "t": 0}}],
        sliders=[{"active": active, "steps": [step(c) for c in choices], "x": 0, "len": 1.0, "y": 1 + px(top_px - 62),
                  "yanchor": "top", "pad": {"t": 0, "b": 0}, "font": {"color": "rgba(0,0,0,0)"},
                  "currentvalue": {"prefix": "SLO bound: P95 TTFT ≤ ", "visible": True, "xanchor": "left",
                                   "font": {"size": 13, "color": "#222222"}},
                  "transition": {"duration": 0}}])
    return fig
