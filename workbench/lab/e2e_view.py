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
"""

from __future__ import annotations

import html

BETTER, WORSE, NOISE, BASE, SKIP = "#54a24b", "#e45756", "#bab0ac", "#4c78a8", "#7f7f7f"


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
    if step.get("within_noise", True) or step.get("winner") is None:
        return NOISE
    improved = step["delta"] < 0 if lower_is_better else step["delta"] > 0
    return BETTER if improved else WORSE


def waterfall_figure(steps: list[dict], metric: str = "TTFT p95", unit: str = "ms", lower_is_better: bool = True,
                     title: str | None = None, height: int = 460):
    """The stack as a waterfall of one metric (``steps``: :meth:`Ablation.waterfall`)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    xs = [("+" if s["kind"] in ("step", "skipped") else "") + s["label"] for s in steps]
    base, height_, colors, patterns, texts, hovers = [], [], [], [], [], []
    level = None
    for s in steps:
        kind = s["kind"]
        if kind == "skipped":
            base.append(level or 0.0)
            height_.append(0.0)
            texts.append("not in the stack" if kind == "skipped" else "")
            hovers.append(f"<b>{html.escape(s['label'])}</b>: not in the stack<br>{_wrap(s.get('reason'))}")
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
    fig.add_bar(x=xs, y=height_, base=base, marker={"color": colors, "pattern_shape": patterns}, text=texts,
                textposition="outside", hovertext=hovers, hoverinfo="text", name=metric, showlegend=False)
    # the runs' range of each measured step, the skipped layers as crosses on the level they left
    rx, ry, rlo, rhi = [], [], [], []
    for x, s in zip(xs, steps):
        if s["kind"] in ("start", "step") and "lo" in s:
            rx.append(x)
            ry.append(s["value"])
            rlo.append(s["value"] - s["lo"])
            rhi.append(s["hi"] - s["value"])
    fig.add_scatter(x=rx, y=ry, mode="markers", marker={"color": "black", "size": 5}, name="runs (min..max)",
                    error_y={"type": "data", "symmetric": False, "array": rhi, "arrayminus": rlo, "thickness": 1.2,
                             "width": 4},
                    hoverinfo="skip")
    sk = [(x, b) for x, b, s in zip(xs, base, steps) if s["kind"] == "skipped"]
    if sk:
        fig.add_scatter(x=[x for x, _ in sk], y=[b for _, b in sk], mode="markers", name="not in the stack",
                        marker={"symbol": "x", "size": 11, "color": SKIP}, hoverinfo="skip")
    # noise bands behind the steps, connectors between consecutive levels
    for i, s in enumerate(steps):
        if s["kind"] == "step" and s.get("noise") is not None:
            fig.add_shape(type="rect", xref="x", yref="y", x0=i - 0.45, x1=i + 0.45, y0=s["prev"] * (1 - s["noise"]),
                          y1=s["prev"] * (1 + s["noise"]), fillcolor="rgba(128,128,128,0.18)", line_width=0,
                          layer="below")
    ends, level = [], None
    for s in steps:
        level = s["value"] if s["kind"] in ("start", "step", "total") else level
        ends.append(level)
    for i in range(len(steps) - 1):
        if ends[i] is not None and steps[i + 1]["kind"] != "total":
            fig.add_shape(type="line", xref="x", yref="y", x0=i + 0.4, x1=i + 0.6, y0=ends[i], y1=ends[i],
                          line={"color": "#888", "width": 1, "dash": "dot"})
    fig.add_bar(x=[None], y=[None], marker_color=BETTER, name="better (beyond noise)")
    fig.add_bar(x=[None], y=[None], marker_color=WORSE, name="worse (beyond noise)")
    fig.add_bar(x=[None], y=[None], marker={"color": NOISE, "pattern_shape": "/"}, name="within noise")
    fig.update_layout(title=title or f"Which layer buys what: {metric} as layers are added (median of the runs)",
                      yaxis_title=f"{metric} ({unit})" if unit else metric, barmode="overlay", height=height,
                      margin={"l": 60, "r": 20, "t": 60, "b": 110}, legend={"orientation": "h", "y": -0.3})
    return fig


def ablation_figure(summary, metric: str = "ttft_ms_p95", label: str = "TTFT p95", unit: str = "ms",
                    verdict_column: str | None = None, height: int = 420):
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
    fig = go.Figure(go.Bar(x=df["config"], y=df[metric], marker_color=colors, hovertext=texts, hoverinfo="text+y",
                           name=label))
    fig.add_hline(y=base, line_dash="dash", line_color=BASE, annotation_text="baseline")
    fig.update_layout(title=f"{label} per configuration (median of the runs; colour: verdict against the baseline)",
                      yaxis_title=f"{label} ({unit})", height=height, margin={"l": 60, "r": 20, "t": 60, "b": 160})
    return fig


def memory_figure(summary, height: int = 420):
    """KV bytes held and weight bytes per configuration, stacked (MiB)."""
    import plotly.graph_objects as go

    df = summary.reset_index()
    fig = go.Figure()
    fig.add_bar(x=df["config"], y=df["weights_bytes"] / 2**20, name="weights", marker_color="#9d755d")
    fig.add_bar(x=df["config"], y=df["kv_bytes"] / 2**20, name="KV held", marker_color="#72b7b2")
    if "kv_used_bytes" in df:
        fig.add_scatter(x=df["config"], y=(df["weights_bytes"] + df["kv_used_bytes"]) / 2**20, mode="markers",
                        name="weights + KV in use at the peak (full precision)",
                        marker={"symbol": "line-ew-open", "size": 18, "color": "black"})
    fig.update_layout(barmode="stack", title="Measured memory per configuration", yaxis_title="MiB", height=height,
                      margin={"l": 60, "r": 20, "t": 60, "b": 160})
    return fig


BREAKDOWN = (("static_step_ms", "static decode step (compiled)", "#72b7b2"), ("matmul_ms", "matmul", "#4c78a8"), ("attention_ms", "attention", "#f58518"),
             ("gather_ms", "gather / scatter of KV", "#e45756"), ("other_model_ms", "other model time", "#bab0ac"),
             ("scheduling_ms", "scheduling", "#54a24b"), ("output_ms", "output", "#b279a2"))


def breakdown_figure(df, height: int = 420):
    """Where each configuration's replay time goes (``df``: :func:`workbench.bench.e2e_breakdown.breakdown`),
    stacked per configuration (ms of one profiled replay)."""
    import plotly.graph_objects as go

    d = df.reset_index()
    fig = go.Figure()
    for col, name, color in BREAKDOWN:
        if col in d:
            fig.add_bar(x=d["config"], y=d[col], name=name, marker_color=color)
    fig.update_layout(barmode="stack", title="Where the time goes: one profiled replay per configuration",
                      yaxis_title="ms (profiled replay)", height=height, margin={"l": 60, "r": 20, "t": 60, "b": 160})
    return fig
