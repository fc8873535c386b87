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
from collections.abc import Mapping

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
        raise ValueError(f"outlier_heatmap: matrix must be [len(labels), channels], got {m.shape} "
                         f"for {len(labels)} labels")
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
    error bars where given, coloured by :func:`ladder_verdict` (with the colour key above the
    plot).  Rows (dicts, dataclasses or a DataFrame): ``recipe`` (the label), ``rel_ppl``
    (``ppl / ppl_reference - 1``, a fraction), ``ppl`` (optional, shown in the hover),
    ``rel_ppl_se`` (optional standard error of ``rel_ppl``, a fraction; a row without it, or with
    None / NaN, gets no error bar).  Rows without ``rel_ppl`` are skipped."""
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
    verdicts = [ladder_verdict(r) for r in rows]
    fig.add_trace(go.Bar(x=[str(r["recipe"]) for r in rows], y=[100 * r["rel_ppl"] for r in rows], error_y=err,
                         marker_color=[VERDICT_COLORS[v] for v in verdicts], name="rel. perplexity", showlegend=False,
                         text=[f"{100 * r['rel_ppl']:+.2f}%" for r in rows], textposition="outside",
                         customdata=[f"{c}<br>{v}" for c, v in zip(ppl, verdicts)],
                         hovertemplate="%{x}: %{y:+.3f}%<br>%{customdata}<extra></extra>"))
    for v in dict.fromkeys(verdicts):       # the colour key: the verdicts that occur, above the plot
        fig.add_trace(go.Bar(x=[None], y=[None], marker_color=VERDICT_COLORS[v], name=v))
    fig.add_hline(y=0, line_color="gray", line_width=1)
    fig.update_xaxes(type="category")
    fig.update_layout(margin=dict(l=60, r=20, t=80, b=60),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0))
    return fig


# a recipe against the reference: worse / better beyond 2 standard errors, within noise, or no error bar
VERDICT_COLORS = {"worse than fp32 (beyond 2 s.e.)": "#D55E00", "better than fp32 (beyond 2 s.e.)": "#009E73",
                  "within noise of fp32 (2 s.e.)": "#bab0ac", "no standard error": "#0072B2"}


def ladder_verdict(row: dict) -> str:
    """The colour-key label of one perplexity row: its change beyond 2 standard errors, or not."""
    se = row.get("rel_ppl_se")
    if se is None or se != se:
        return "no standard error"
    if abs(row["rel_ppl"]) <= 2 * se:
        return "within noise of fp32 (2 s.e.)"
    return "worse than fp32 (beyond 2 s.e.)" if row["rel_ppl"] > 0 else "better than fp32 (beyond 2 s.e.)"


def kernel_speed_figure(rows, title: str = "Quantized matmul: speedup over the dense layer vs m"):
    """Speedup (dense time / quantized time) against ``m`` (tokens per matmul, log-2 axis), one
    line per (``kernel``, ``source``): colour by kernel, solid for ``"CPU"``, dashed for ``"GPU"``;
    a grey line at 1 (as fast as dense).  Rows: ``m``, ``kernel``, ``speedup``, ``source``;
    optional ``speedup_min`` / ``speedup_max`` as error bars."""
    import plotly.graph_objects as go

    rows = [r for r in _records(rows) if r.get("m") and r.get("speedup") is not None]
    fig = go.Figure()
    fig.update_layout(title=title, height=400, margin=dict(l=60, r=20, t=50, b=50), yaxis_title="speedup (x)",
                      hovermode="closest",
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0))
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
    # the key under the plot, at the figure's bottom, with room made for it: above the plot it covered the
    # title once it wrapped (4 CPU ops and 3 GPU kernels)
    key_rows = math.ceil(len(groups) / 2)
    fig.update_layout(height=400 + 22 * key_rows, margin=dict(l=60, r=20, t=50, b=70 + 22 * key_rows),
                      legend=dict(orientation="h", yref="container", y=0, yanchor="bottom", xanchor="left", x=0,
                                  font=dict(size=11)))
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
    fig.update_layout(title=title or f"{ds}: {metric} degradation vs {res['objective']} "
                                     f"({len(measured)} mixes measured)",
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


# ---- a control over the calibrator's measured mixes: the quality bound --------------------------------

PICK_PREFIX = "pick:"                      # the quality-bound figure's annotation starts with it (a DOM hook)
QUALITY_BOUND_META = "wb-quality-bound"    # its layout.meta (a DOM hook: gd.layout.meta)
WITHIN, OVER, PICKED = "#0072B2", "#999999", "#009E73"     # Okabe-Ito: colour-blind safe


def quality_bound_choices(res: dict, noise: float | None = None, bounds=None) -> list[dict]:
    """For each quality bound a slider offers, the mix the calibrator's first step would pick among
    the **measured** mixes of ``res`` (:func:`workbench.quant.calibrate.calibrate`): within the
    bound on the search text, the cheapest (bytes), or for latency the fastest median unless a mix
    not slower beyond the noise degrades less beyond 2 standard errors
    (:func:`workbench.quant.recommend._pick`, the rule the calibrator uses).  By default the bounds
    are where the pick can change: 0 and each measured mix's degradation, plus the calibrator's
    limit.  Each choice: ``bound``, ``pick`` (the row), ``within`` (key -> within the bound),
    ``limit`` (True at the calibrator's limit)."""
    from workbench.quant.recommend import _pick

    cands = res["candidates"]
    limit = float(res["max_degradation"])
    if bounds is None:
        bounds = {max(0.0, float(c["degradation"])) for c in cands}
    bounds = {b for b in bounds if abs(b - limit) > 1e-12} | {limit}
    out = []
    for b in sorted(bounds):
        ok = [c for c in cands if c["degradation"] <= b + 1e-12]
        pick = _pick(ok, res["objective"], noise) if ok else None
        out.append({"bound": b, "pick": pick, "within": {c["key"]: c["degradation"] <= b + 1e-12 for c in cands},
                    "limit": b == limit})
    return out


def _cost_text(res: dict, row: dict) -> str:
    if res["objective"] == "latency":
        text = f"{row['cost']:.2f} ms a decode step"
    else:
        text = f"{row['cost'] / 2**20:.2f} MiB"
    vs = row.get("cost_vs_unquantized")
    return text + (f" ({vs:.2f}x)" if vs is not None and row["key"] != "unquantized" else "")


def _same_mix(a: dict, b: dict) -> bool:
    return a.get("assignment") is not None and a.get("assignment") == b.get("assignment")


def pick_text(results: list[dict], picks: list[dict | None], bound: float, scale: float, unit: str) -> str:
    """The quality-bound figure's annotation for one slider position: starts with :data:`PICK_PREFIX`,
    one line per objective (the pick, its cost and quality; a memory pick also says its decode step
    when the latency search measured the same mix)."""
    lines = []
    for res, p in zip(results, picks):
        what = "smallest" if res["objective"] == "memory" else "fastest"
        if p is None:
            lines.append(f"{res['objective']}: none within {scale * bound:+.2f}{unit}")
            continue
        q = f"{scale * p['degradation']:+.2f}{unit} ± {scale * (p['degradation_se'] or 0):.2f}"
        extra = ""
        if res["objective"] == "memory":
            lat = next((r for o in results if o["objective"] == "latency" for r in o["candidates"]
                        if _same_mix(r, p)), None)
            if lat is not None:
                extra = f", its decode step {lat['cost']:.2f} ms"
        lines.append(f"{what}: <b>{html.escape(p['key'])}</b> ({html.escape(p['label'])}) · "
                     f"{_cost_text(res, p)}{extra} · ppl {q}")
    return f"<b>{PICK_PREFIX}</b> " + "<br>".join(lines)


def _bound_panel(fig, j: int, n: int, res: dict, ch: dict, metric: str, scale: float, unit: str,
                 limit: float) -> tuple:
    """Panel ``j`` of ``n`` of the quality-bound figure: ``res``'s measured mixes coloured by the
    choice ``ch`` (the slider's starting step), the bound line, the pick's star, the calibrator's
    limit (dashed) and the panel's axes.  Returns what a slider step restyles: (keys, xs, ys, x
    span, cost divisor, index of the panel's first trace)."""
    import plotly.graph_objects as go

    gap = 0.08
    width = (1 - gap * (n - 1)) / n
    ax = "" if j == 0 else str(j + 1)
    x_title, div = _cost_axis(res)
    cands = res["candidates"]
    keys = [c["key"] for c in cands]
    xs = [c["cost"] / div for c in cands]
    ys = [scale * c["degradation"] for c in cands]
    pad = 0.06 * ((max(xs) - min(xs)) or abs(max(xs)) or 1.0)
    span = [min(xs) - pad, max(xs) + pad]
    err_x = None
    if res["objective"] == "latency" and all("ms_min" in c for c in cands):
        err_x = dict(type="data", symmetric=False, array=[c["ms_max"] - c["ms"] for c in cands],
                     arrayminus=[c["ms"] - c["ms_min"] for c in cands], thickness=1, color="#777777")
    axes = {"xaxis": f"x{ax}", "yaxis": f"y{ax}"}
    fig.add_trace(go.Scatter(
        x=xs, y=ys, mode="markers", name="measured mix", showlegend=False, **axes,
        text=[f"{c['key']}: {c['label']}" for c in cands], error_x=err_x,
        error_y=dict(type="data", array=[2 * scale * (c["degradation_se"] or 0) for c in cands], thickness=1,
                     color="#777777"),
        marker=dict(color=[WITHIN if ch["within"][k] else OVER for k in keys], size=11,
                    line=dict(width=1, color="white")),
        hovertemplate="%{text}<br>cost %{x:.3f}<br>degradation %{y:+.2f}" + unit + "<extra></extra>"))
    fig.add_trace(go.Scatter(x=span, y=[scale * ch["bound"]] * 2, mode="lines", name="the bound (slider)",
                             line=dict(color="black", dash="dot", width=2), hoverinfo="skip", showlegend=j == 0,
                             **axes))
    p = ch["pick"]
    fig.add_trace(go.Scatter(x=[p["cost"] / div] if p else [None], y=[scale * p["degradation"]] if p else [None],
                             mode="markers", name="the pick", hoverinfo="skip", showlegend=j == 0, **axes,
                             marker=dict(symbol="star", size=20, color=PICKED, line=dict(width=1, color="black"))))
    fig.add_shape(type="line", xref=f"x{ax} domain", yref=f"y{ax}", x0=0, x1=1, y0=scale * limit, y1=scale * limit,
                  line=dict(color="#D55E00", dash="dash", width=1.5))
    fig.update_layout({f"xaxis{ax}": dict(domain=[j * (width + gap), j * (width + gap) + width], anchor=f"y{ax}",
                                          title=dict(text=x_title, font=dict(size=12))),
                       f"yaxis{ax}": dict(anchor=f"x{ax}", title=dict(text=f"{metric} increase ({unit.strip()})"
                                                                      if metric == "ppl" else metric)
                                          if j == 0 else None, matches="y" if j else None)})
    return keys, xs, ys, span, div, len(fig.data) - 3


def _bound_key(fig) -> None:
    """The quality-bound figure's colour key: legend-only entries for within / over the bound
    and the calibrator's limit."""
    import plotly.graph_objects as go

    for color, name in ((WITHIN, "within the bound"), (OVER, "over the bound")):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name=name, marker=dict(color=color, size=10)))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name="the calibrator's limit",
                             line=dict(color="#D55E00", dash="dash", width=1.5)))


def _bound_step(i: int, results: list, panels: list, per: list, scale: float, unit: str) -> dict:
    """Slider step ``i`` of the quality-bound figure: restyles each panel's mixes, bound line and
    star (``panels`` from :func:`_bound_panel`) to the choices ``per[panel][i]`` and rewrites the
    picks' annotation."""
    data = {"marker.color": [], "x": [], "y": []}
    idx = []
    for (keys, xs, ys, span, div, first), choices in zip(panels, per):
        ch = choices[i]
        pk = ch["pick"]
        data["marker.color"] += [[WITHIN if ch["within"][k] else OVER for k in keys], None, PICKED]
        data["x"] += [xs, span, [pk["cost"] / div] if pk else [None]]
        data["y"] += [ys, [scale * ch["bound"]] * 2, [scale * pk["degradation"]] if pk else [None]]
        idx += [first, first + 1, first + 2]
    b = per[0][i]["bound"]
    text = pick_text(results, [c[i]["pick"] for c in per], b, scale, unit)
    return {"method": "update", "label": f"{scale * b:+.2f}{unit}" + (" (the limit)" if per[0][i]["limit"] else ""),
            "args": [data, {"annotations[0].text": text}, idx]}


def _bound_annotations(fig, results: list, picks: list, limit: float, scale: float, unit: str, y: float) -> None:
    """The picks' annotation at paper height ``y`` (``annotations[0]``: the slider rewrites it),
    then each panel's objective above the panel."""
    fig.add_annotation(text=pick_text(results, picks, limit, scale, unit), xref="paper",
                       yref="paper", x=0, y=y, xanchor="left", yanchor="top", showarrow=False,
                       align="left", font={"size": 12})
    for j, res in enumerate(results):
        ax = "" if j == 0 else str(j + 1)
        fig.add_annotation(text=f"<b>{res['objective']} objective</b>: pick the "
                                f"{'smallest' if res['objective'] == 'memory' else 'fastest'} within the bound",
                           xref=f"x{ax} domain", yref=f"y{ax} domain", x=0, y=1, yshift=4, xanchor="left",
                           yanchor="bottom", showarrow=False, font={"size": 12})


def quality_bound_figure(results, noise: float | None = None, title: str | None = None, height: int = 580):
    """The calibrator's measured mixes (quality against cost), one panel per result in ``results``
    (:func:`workbench.quant.calibrate.calibrate` results on one text, e.g. the memory and the latency
    objective), with one **quality-bound slider** (plotly's own: it works without a kernel, in a
    saved notebook and the HTML report).  Each step is a bound on the degradation
    (:func:`quality_bound_choices`, precomputed), drawn as a dotted line: the mixes within it are
    blue, the others grey, each panel's pick a star, and the annotation (it starts with ``pick:``)
    names each pick with its cost (stored MiB; a decode step's ms) and quality.  The slider starts
    at the calibrator's limit.  The pick is the calibrator's first step, on the search text; its
    recommendation is then confirmed on the confirmation text (printed beside the figure).
    ``layout.meta`` is :data:`QUALITY_BOUND_META`."""
    import plotly.graph_objects as go

    results = [results] if isinstance(results, Mapping) else list(results)      # one result (or its JSON dict)
    metric = results[0]["target_metric"]
    scale, unit = (100.0, " %") if metric == "ppl" else (1.0, "")
    limit = float(results[0]["max_degradation"])
    bounds = {limit} | {max(0.0, float(c["degradation"])) for r in results for c in r["candidates"]}
    per = [quality_bound_choices(r, noise, bounds) for r in results]
    active = next(i for i, c in enumerate(per[0]) if c["limit"])
    fig = go.Figure()
    panels = [_bound_panel(fig, j, len(results), res, per[j][active], metric, scale, unit, limit)
              for j, res in enumerate(results)]
    _bound_key(fig)
    # pixels from the top: title, slider (its current value above the rail), the picks, the colour key
    top, bottom = 230, 60
    plot = height - top - bottom
    px = lambda v: 1 + v / plot           # noqa: E731 - px above the plot area -> paper
    _bound_annotations(fig, results, [c[active]["pick"] for c in per], limit, scale, unit, px(top - 130))
    ds = str(results[0]["dataset"]).rsplit("/", 1)[-1]
    fig.update_layout(
        meta=QUALITY_BOUND_META, template="plotly_white", height=height,
        title={"text": title or f"{ds}: move the quality bound; each objective's pick among the measured mixes",
               "x": 0, "xanchor": "left", "y": 1 - 10 / height, "yanchor": "top"},
        margin={"l": 60, "r": 20, "t": top, "b": bottom},
        legend={"orientation": "h", "x": 1, "xanchor": "right", "y": px(28), "yanchor": "bottom", "font": {"size": 11},
                "bgcolor": "rgba(0,0,0,0)"},
        sliders=[{"active": active, "steps": [_bound_step(i, results, panels, per, scale, unit)
                                              for i in range(len(per[0]))],
                  "x": 0, "len": 1.0, "y": px(top - 45),
                  "yanchor": "top", "pad": {"t": 0, "b": 0}, "font": {"color": "rgba(0,0,0,0)"},
                  "currentvalue": {"prefix": f"quality bound: {metric} increase at most ", "visible": True,
                                   "xanchor": "left", "font": {"size": 13, "color": "#222222"}},
                  "transition": {"duration": 0}}])
    return fig


def step_messages(bar):
    """A ``progress(text)`` callback for functions that announce each item as it starts
    (``quality_rows``, ``preset_rows``): the previous item counts as done when the next one starts,
    on a :class:`workbench.lab.progress.Progress` ``bar``; call ``bar.advance()`` after the last."""
    started = [False]

    def say(text: str) -> None:
        if started[0]:
            bar.advance()
        started[0] = True
        bar.start(text)
    return say
