"""Notebook 05's views (quantization): outlier heatmaps, output error by scheme, perplexity by
recipe, quantized-kernel speed.

The numbers come from :mod:`workbench.quant.outliers` (activation / weight maps, scheme errors)
and from the quantization benchmarks (perplexity and kernel rows); this module only draws them
(plotly imported inside the functions).  ::

    labels, m = activation_map(stats, "down_proj")
    outlier_heatmap(labels, m, "down_proj input: max |x| per channel")
    scheme_error_figure(scheme_errors(w, stats[name].rows))
    perplexity_figure(rows)          # recipe, ppl, rel_ppl, rel_ppl_se
    kernel_speed_figure(rows)        # m, kernel, speedup, source
"""

from __future__ import annotations

import html
import math

import numpy as np

from workbench.lab.prefetch_sweeps import _records    # rows from dicts, dataclasses or a DataFrame

COLORS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#72b7b2", "#eeca3b", "#9d755d", "#bab0ac")
OUTLIER_COLOR = "#d62728"
REST_COLOR = "#4c78a8"
SOURCE_DASH = {"CPU": "solid", "GPU": "dash"}


def _array(matrix) -> np.ndarray:
    if hasattr(matrix, "detach"):
        matrix = matrix.detach().float().cpu().numpy()
    return np.asarray(matrix, dtype=np.float64)


def _empty(fig, text: str):
    fig.add_annotation(text=text, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                       font=dict(size=14, color="gray"))
    return fig


def outlier_heatmap(labels, matrix, title: str, log: bool = True, top: int = 4, x_title: str = "input channel",
                    value: str = "max |x|"):
    """Layers x channels heatmap of a magnitude (``matrix [n_layers, channels]``, e.g. from
    :func:`~workbench.quant.outliers.activation_map` / :func:`~workbench.quant.outliers.weight_map`;
    ``log10`` of it with ``log``), one row per ``labels`` entry, first layer on top.  The ``top``
    channels of each row (the ones that set its range) are marked by open red circles (a scatter
    trace over the heatmap); hover gives the value and its ratio to the row's median."""
    import plotly.graph_objects as go

    m = _array(matrix)
    if m.ndim != 2 or m.shape[0] != len(labels):
        raise ValueError(f"outlier_heatmap: matrix must be [len(labels), channels], got {m.shape} for {len(labels)} labels")
    labels = [str(lab) for lab in labels]
    med = np.median(m, axis=1, keepdims=True)
    ratio = np.divide(m, med, out=np.full_like(m, np.inf), where=med > 0)
    z = np.log10(np.maximum(m, 1e-12)) if log else m
    channels = list(range(m.shape[1]))
    fig = go.Figure(go.Heatmap(z=z, x=channels, y=labels, customdata=np.stack([m, ratio], -1), colorscale="Viridis",
                               colorbar=dict(title=f"log10 {value}" if log else value),
                               hovertemplate="%{y}, channel %{x}: " + value +
                               " %{customdata[0]:.4g} (%{customdata[1]:.2f}x median)<extra></extra>"))
    k = min(top, m.shape[1])
    if k > 0:
        idx = np.argsort(-m, axis=1, kind="stable")[:, :k]
        xs = [int(c) for row in idx for c in row]
        ys = [lab for lab, row in zip(labels, idx) for _ in row]
        vals = [[float(m[i, c]), float(ratio[i, c])] for i, row in enumerate(idx) for c in row]
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", name=f"top {k} channels per layer (set the range)",
                                 customdata=vals,
                                 marker=dict(symbol="circle-open", size=9, color=OUTLIER_COLOR, line=dict(width=2)),
                                 hovertemplate="%{y}, channel %{x}: " + value +
                                 " %{customdata[0]:.4g} (%{customdata[1]:.2f}x median)<extra>top</extra>"))
    fig.update_layout(title=title, xaxis_title=x_title, yaxis_title="layer", yaxis_autorange="reversed",
                      yaxis_type="category", height=140 + 34 * len(labels), margin=dict(l=60, r=20, t=50, b=40),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0))
    return fig


def scheme_error_figure(rows, title: str = "Output error by quantization scheme: outlier channels vs the rest"):
    """Stacked bars of the relative output error ``||x W^T - x_q W_q^T|| / ||x W^T||`` per scheme
    (rows of :func:`~workbench.quant.outliers.scheme_errors`: ``scheme``, ``rel_error``,
    ``outlier_error``, ``rest_error``, ``outlier_share``; optional ``granularity``, ``layer``).
    The bar's height is ``rel_error``, split in the proportion of the error energy from the outlier
    channels (``outlier_share``) and from the others.  Rows with several ``layer`` values get a
    two-level x axis (layer, scheme)."""
    import plotly.graph_objects as go

    rows = [r for r in _records(rows) if r.get("rel_error") is not None]
    fig = go.Figure()
    fig.update_layout(title=title, height=400, margin=dict(l=60, r=20, t=50, b=60), barmode="stack",
                      yaxis_title="relative output error", legend=dict(orientation="h", yanchor="bottom", y=1.0,
                                                                      xanchor="right", x=1.0))
    if not rows:
        return _empty(fig, "no rows")
    layers = list(dict.fromkeys(str(r["layer"]) for r in rows if "layer" in r))
    names = [str(r["scheme"]) for r in rows]
    x = [[str(r.get("layer", "")) for r in rows], names] if len(layers) > 1 else names
    share = [float(r.get("outlier_share", 0.0)) for r in rows]
    tot = [float(r["rel_error"]) for r in rows]
    info = [[float(r.get("outlier_error", math.nan)), float(r.get("rest_error", math.nan)), t,
             html.escape(str(r.get("granularity", "")))] for r, t in zip(rows, tot)]
    for label, part, color in (("outlier channels", [t * s for t, s in zip(tot, share)], OUTLIER_COLOR),
                               ("other channels", [t * (1 - s) for t, s in zip(tot, share)], REST_COLOR)):
        fig.add_trace(go.Bar(x=x, y=part, name=label, marker_color=color, customdata=info,
                             hovertemplate="%{x}: total %{customdata[2]:.4f}<br>outlier channels ||E_O||/||Y|| "
                             "%{customdata[0]:.4f}, others ||E_R||/||Y|| %{customdata[1]:.4f}<br>"
                             "%{customdata[3]}<extra>" + label + "</extra>"))
    fig.add_trace(go.Scatter(x=x, y=tot, mode="text", text=[f"{t:.3g}" for t in tot], textposition="top center",
                             showlegend=False, hoverinfo="skip"))
    return fig


def perplexity_figure(rows, title: str = "Perplexity by quantization recipe (relative to the unquantized model)"):
    """Bars of the relative perplexity change (%) per recipe, in row order, with +-1 standard
    error bars where given.  Rows (dicts, dataclasses or a DataFrame): ``recipe`` (the label),
    ``rel_ppl`` (``ppl / ppl_reference - 1``, a fraction), ``ppl`` (optional, shown in the
    hover), ``rel_ppl_se`` (optional standard error of ``rel_ppl``, a fraction; a row without it,
    or with None / NaN, gets no error bar).  Rows without ``rel_ppl`` are skipped."""
    import plotly.graph_objects as go

    rows = [r for r in _records(rows) if r.get("rel_ppl") is not None]
    fig = go.Figure()
    fig.update_layout(title=title, height=400, margin=dict(l=60, r=20, t=50, b=60),
                      yaxis_title="perplexity change (%)", xaxis_title="recipe")
    if not rows:
        return _empty(fig, "no rows")
    se = [r.get("rel_ppl_se") for r in rows]
    err = (dict(type="data", array=[100 * s if s is not None else None for s in se], thickness=1.2, width=4)
           if any(s is not None for s in se) else None)
    ppl = [f"ppl {r['ppl']:.3f}" if r.get("ppl") is not None else "" for r in rows]
    fig.add_trace(go.Bar(x=[str(r["recipe"]) for r in rows], y=[100 * r["rel_ppl"] for r in rows], error_y=err,
                         marker_color=[COLORS[i % len(COLORS)] for i in range(len(rows))], name="rel. perplexity",
                         text=[f"{100 * r['rel_ppl']:+.2f}%" for r in rows], textposition="outside", customdata=ppl,
                         hovertemplate="%{x}: %{y:+.3f}%<br>%{customdata}<extra></extra>"))
    fig.add_hline(y=0, line_color="gray", line_width=1)
    fig.update_xaxes(type="category")
    return fig


def kernel_speed_figure(rows, title: str = "Quantized matmul: speedup over the dense layer vs m"):
    """Speedup (dense time / quantized time) against ``m`` (tokens per matmul, log-2 axis), one
    line per (``kernel``, ``source``): colour by kernel, solid for ``"CPU"``, dashed for ``"GPU"``;
    a grey line at 1 (as fast as dense).  Rows: ``m``, ``kernel``, ``speedup``, ``source``;
    optional ``speedup_min`` / ``speedup_max`` as error bars."""
    import plotly.graph_objects as go

    rows = [r for r in _records(rows) if r.get("m") and r.get("speedup") is not None]
    fig = go.Figure()
    fig.update_layout(title=title, height=400, margin=dict(l=60, r=20, t=50, b=50), yaxis_title="speedup (x)",
                      hovermode="closest", legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0))
    if not rows:
        return _empty(fig, "no rows")
    kernels = list(dict.fromkeys(str(r.get("kernel", "")) for r in rows))
    groups: dict = {}
    for r in sorted(rows, key=lambda r: r["m"]):
        groups.setdefault((str(r.get("kernel", "")), str(r.get("source", ""))), []).append(r)
    for (kernel, source), sub in groups.items():
        has_err = any(r.get("speedup_min") is not None or r.get("speedup_max") is not None for r in sub)
        err = (dict(type="data", symmetric=False, thickness=1.2, width=4,
                    array=[max(0.0, r["speedup_max"] - r["speedup"]) if r.get("speedup_max") is not None else None
                           for r in sub],
                    arrayminus=[max(0.0, r["speedup"] - r["speedup_min"]) if r.get("speedup_min") is not None else None
                                for r in sub]) if has_err else None)
        name = f"{kernel} ({source})" if source else kernel
        fig.add_trace(go.Scatter(x=[r["m"] for r in sub], y=[r["speedup"] for r in sub], mode="lines+markers",
                                 name=name, error_y=err,
                                 line=dict(color=COLORS[kernels.index(kernel) % len(COLORS)], width=2,
                                           dash=SOURCE_DASH.get(source.upper(), "dot")),
                                 hovertemplate=html.escape(name) + " m=%{x}: %{y:.2f}x<extra></extra>"))
    fig.add_hline(y=1, line_color="gray", line_dash="dot", annotation_text="dense", annotation_position="bottom right")
    ms = sorted({int(r["m"]) for r in rows})
    fig.update_xaxes(type="log", title_text="m (tokens per matmul)", tickvals=ms, ticktext=[str(m) for m in ms])
    return fig


KIND_STYLE = {"unquantized": ("#222222", "square"), "uniform": ("#4c78a8", "circle"), "front": ("#f58518", "diamond")}


def _cost_axis(res: dict) -> tuple[str, float]:
    if res["objective"] == "memory":
        return "resident bytes of the model (MiB, measured)", 2.0 ** 20
    return "decode step (ms, median of interleaved rounds, measured)", 1.0


def calibration_pareto_figure(res: dict, title: str | None = None):
    """Quality against cost for a :func:`workbench.quant.calibrate.calibrate` result: every
    measured mix on the search text (error bars: 2 paired standard errors of its degradation;
    cost ranges for latency), the predicted front mixes not measured (grey; memory only), the
    limit (dashed), the recommendation at its confirmation-text figure (star)."""
    import plotly.graph_objects as go

    metric = res["target_metric"]
    scale = 100.0 if metric == "ppl" else 1.0          # ppl degradation in percent
    y_title = {"ppl": "perplexity increase (%)", "kl": "KL to the unquantized model (nats)",
               "top1": "top-1 accuracy lost (points)", "exact_match": "exact match lost (points)"}[metric]
    x_title, div = _cost_axis(res)
    fig = go.Figure()
    measured = {r["key"] for r in res["candidates"]}
    pred = [f for f in res.get("front", []) if not f.get("measured_as")]
    if pred and res["objective"] == "memory":
        # predicted bytes sum the linear layers only; the offset (everything else, measured on the
        # unquantized model) puts them on the measured axis.  Predicted latency has no such offset
        # (a step is more than its matmuls), so unmeasured latency mixes are not drawn.
        off = res.get("cost_offset", 0.0)
        fig.add_trace(go.Scatter(x=[(f["predicted_cost"] + off) / div for f in pred],
                                 y=[scale * f["predicted_degradation"] for f in pred], mode="markers",
                                 name="front, predicted (not measured)", text=[f["label"] for f in pred],
                                 marker=dict(color="#bbbbbb", symbol="diamond-open", size=7),
                                 hovertemplate="%{text}<br>predicted: %{y:.3g}<extra></extra>"))
    for kind, (color, symbol) in KIND_STYLE.items():
        rows = [r for r in res["candidates"] if (r["key"] == "unquantized") == (kind == "unquantized")
                and (kind == "unquantized" or r["kind"] == kind)]
        if not rows:
            continue
        x = [r["cost"] / div for r in rows]
        err_x = None
        if res["objective"] == "latency":
            err_x = dict(type="data", symmetric=False, array=[r["ms_max"] - r["ms"] for r in rows],
                         arrayminus=[r["ms"] - r["ms_min"] for r in rows], thickness=1, color=color)
        fig.add_trace(go.Scatter(
            x=x, y=[scale * r["degradation"] for r in rows], mode="markers", name=f"{kind} (measured)",
            text=[f"{r['key']}: {r['label']}" for r in rows], error_x=err_x,
            error_y=dict(type="data", array=[2 * scale * (r["degradation_se"] or 0) for r in rows], thickness=1,
                         color=color),
            marker=dict(color=color, symbol=symbol, size=10, line=dict(width=1, color="white")),
            hovertemplate="%{text}<br>cost %{x:.4g}<br>degradation %{y:.3g}<extra></extra>"))
    rec = res["recommendation"]
    fig.add_trace(go.Scatter(x=[rec["cost"] / div], y=[scale * rec["degradation"]], mode="markers",
                             name="recommended (on the confirmation text)", text=[rec["label"]],
                             marker=dict(color="#d62728", symbol="star", size=18, line=dict(width=1, color="black")),
                             hovertemplate="recommended: %{text}<extra></extra>"))
    fig.add_hline(y=scale * res["max_degradation"], line_dash="dash", line_color="#d62728",
                  annotation_text="limit", annotation_position="top left")
    ds = str(res["dataset"]).rsplit("/", 1)[-1]
    fig.update_layout(title=title or f"{ds}: {metric} degradation vs {res['objective']} ({len(measured)} mixes measured)",
                      xaxis_title=x_title, yaxis_title=y_title, template="plotly_white", height=430,
                      legend=dict(orientation="h", y=-0.2))
    return fig


def sensitivity_heatmap(res: dict, option: str | None = None, title: str | None = None):
    """Decoder block x unit kind (a layer, or ``qkv_proj`` / ``gate_up_proj`` when the fused
    layers are tied): the target metric's degradation with only that unit quantized under
    ``option`` (default: the search space's last scheme)."""
    import plotly.graph_objects as go

    metric = res["target_metric"]
    opts = [o for o in res["search_space"] if o != "dense"]
    option = option or opts[-1]
    rows = [r for r in res["sensitivity"] if r["option"] == option]
    if not rows:
        return _empty(go.Figure(), f"no sensitivity rows for {option}")
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    blocks = sorted({r["block"] for r in rows})
    scale = 100.0 if metric == "ppl" else 1.0
    z = [[None] * len(kinds) for _ in blocks]
    se = [[None] * len(kinds) for _ in blocks]
    for r in rows:
        i, j = blocks.index(r["block"]), kinds.index(r["kind"])
        z[i][j], se[i][j] = scale * r[metric][0], scale * r[metric][1]
    unit = "%" if metric == "ppl" else ""
    fig = go.Figure(go.Heatmap(z=z, x=kinds, y=[f"L{b}" for b in blocks], customdata=se, colorscale="Reds",
                               colorbar=dict(title=f"{metric} {unit}".strip()),
                               hovertemplate="%{y}.%{x}: %{z:.3g} +- %{customdata:.2g}<extra></extra>"))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title or f"Sensitivity: {metric} degradation with one layer under {option}",
                      template="plotly_white", height=320)
    return fig
