"""Notebook 02's views (KV tiers) that are not block maps (those are in :mod:`workbench.lab.kv_view`).

* :func:`pca_figure`: explained variance of PCA bases of keys: the mean curve per key space, and
  per layer and KV head at one rank, before vs after RoPE;
* :func:`pareto_figure`: memory reduction vs perplexity change of every configuration of a tier
  sweep, the Pareto front drawn over them (also re-exported by :mod:`workbench.lab.kv_view`);
* :func:`kl_figure`: memory reduction vs KL to the full cache, tiered configurations vs the
  sliding-window control, on a log axis labelled by :func:`log_ticks`;
* :func:`add_config_picker`: a dropdown over the measured sweep's rows (plotly's own, so it works
  without a kernel and in the report) that rings the chosen configuration on the Pareto figure and
  says its memory and quality; :func:`short_labels` names configurations by what sets them apart.

The data come from :mod:`workbench.bench.kv_experiments` and :mod:`workbench.bench.tier_eval`.
"""

from __future__ import annotations

import math

KEY_SPACE_DASH = (("post_rope", "solid"), ("pre_rope", "dash"))
KEY_SPACE_LABEL = {"post_rope": "keys after RoPE (post_rope)", "pre_rope": "keys before RoPE (pre_rope)"}
# the sliding-window control (cold_mode="drop"): a hollow black marker, so a point drawn over it stays visible
CONTROL_MARKER = {"symbol": "diamond-open", "size": 13, "color": "black", "line": {"width": 2}}
TIERED_MARKER = {"symbol": "circle", "size": 9, "color": "#4c78a8"}
FRONT_STYLE = {"marker": {"symbol": "circle", "size": 8, "color": "#e45756", "line": {"width": 1, "color": "white"}},
               "line": {"color": "#e45756", "width": 2}}


def _tick_text(v: float) -> str:
    """0.005 -> '0.005', 20 -> '20', 2e-05 -> '2e-5': plain decimals where they stay short."""
    if 1e-3 <= v < 1e5:
        return f"{v:.6f}".rstrip("0").rstrip(".") if v < 1 else f"{v:g}"
    m, e = f"{v:.0e}".split("e")
    return f"{m}e{int(e)}"


def log_ticks(values, min_ticks: int = 3) -> tuple[list[float], list[str]]:
    """Tick values and labels for a log axis over ``values`` (positive ones; others ignored):
    1-2-5 steps per decade, every integer step (1-9) when that gives fewer than ``min_ticks``
    inside the data's range, and the range's two ends when even that does not.  Plotly's own
    log ticks label the minor steps with bare digits ("7 6 5 4 3 2 0.01 9 8"); every label here
    is the whole value (``0.005``, ``0.01``, ``0.02``)."""
    vs = [float(v) for v in values if v is not None and not math.isnan(v) and v > 0]
    if not vs:
        return [], []
    lo, hi = min(vs), max(vs)
    for mantissas in ((1, 2, 5), tuple(range(1, 10))):
        ticks = [m * 10.0 ** e for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 1)
                 for m in mantissas]
        ticks = [float(f"{t:.12g}") for t in ticks]
        inside = [t for t in ticks if lo <= t <= hi]
        if len(inside) >= min_ticks:
            break
    # one tick either side of the data, so the padded axis range ends on a labelled value
    vals = [t for t in ticks if t < lo][-1:] + inside + [t for t in ticks if t > hi][:1]
    if len(inside) < 2:                     # a narrow range: its ends too, unless they crowd a tick already there
        for t in (float(f"{lo:.2g}"), float(f"{hi:.2g}")):
            if all(max(t, u) / min(t, u) > 1.15 for u in vals):
                vals.append(t)
        vals.sort()
    return vals, [_tick_text(v) for v in vals]


def pca_figure(bases: dict, ev, rank: int = 8):
    """Explained variance of keys, three panels: the mean over layers and KV heads per rank, one
    line per key space (from ``ev``, :func:`workbench.bench.kv_experiments.explained_variance_frame`),
    then a ``[layers, kv heads]`` heatmap at ``rank`` for post-RoPE and for pre-RoPE keys
    (``bases``: key space -> ``PCABasis``; both key spaces are needed)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    missing = [ks for ks, _ in KEY_SPACE_DASH if ks not in bases]
    if missing:
        raise KeyError(f"pca_figure: bases lack key space(s) {missing}")
    mean_ev = ev.groupby(["key_space", "rank"])["explained"].mean().unstack(0)
    fig = make_subplots(rows=1, cols=3, column_widths=[0.4, 0.3, 0.3], horizontal_spacing=0.08,
                        subplot_titles=["mean over layers and heads", f"post-RoPE, rank {rank}",
                                        f"pre-RoPE, rank {rank}"])
    for ks, dash in KEY_SPACE_DASH:
        fig.add_trace(go.Scatter(x=mean_ev.index, y=mean_ev[ks], name=KEY_SPACE_LABEL[ks], line_dash=dash,
                                 hovertemplate="rank %{x}: %{y:.1%}<extra>" + ks + "</extra>"), row=1, col=1)
    for col, ks in ((2, "post_rope"), (3, "pre_rope")):
        grid = bases[ks].explained(rank).numpy()                       # [layers, kv heads]
        fig.add_trace(go.Heatmap(z=grid, zmin=0, zmax=1, colorscale="Viridis", showscale=col == 3,
                                 colorbar={"title": f"explained<br>at rank {rank}", "tickformat": ".0%"},
                                 x=[f"kv{h}" for h in range(grid.shape[1])], y=[f"L{l}" for l in range(grid.shape[0])],
                                 hovertemplate="%{y} %{x}: %{z:.1%}<extra>" + ks + "</extra>"), row=1, col=col)
    fig.update_xaxes(title_text="rank (PCA components kept)", row=1, col=1)
    fig.update_yaxes(title_text="explained variance", tickformat=".0%", row=1, col=1)
    for col in (2, 3):
        fig.update_xaxes(title_text="KV head", row=1, col=col)
    fig.update_yaxes(title_text="layer", row=1, col=2)
    fig.update_layout(title=f"PCA of keys ({bases['post_rope'].num_tokens:,} tokens): explained variance", height=400,
                      legend=dict(orientation="h", x=0, y=-0.25))
    return fig


def kl_figure(tiered, control):
    """Memory reduction (x) vs KL(full || tiered) (log scale, ticks from :func:`log_ticks`), one
    marker per configuration: ``tiered`` (hot / warm / cold, filled circles) and ``control`` (the
    sliding-window control, hollow diamonds), both rows of a tier sweep with ``name``,
    ``reduction`` and ``kl``."""
    import plotly.graph_objects as go

    fig = go.Figure([go.Scatter(x=part["reduction"], y=part["kl"], mode="markers", name=label, text=part["name"],
                                marker=marker, hovertemplate="%{text}<br>%{x:.2f}x, KL %{y:.4f}<extra></extra>")
                     for part, label, marker in ((tiered, "hot / warm / cold", TIERED_MARKER),
                                                 (control, "sliding-window control (cold dropped)", CONTROL_MARKER))])
    vals, text = log_ticks(list(tiered["kl"]) + list(control["kl"]))
    yaxis = {"type": "log", "title": "KL(full || tiered), nats per token (log scale)",
             "tickvals": vals, "ticktext": text}
    if vals:
        yaxis["range"] = [math.log10(vals[0]), math.log10(vals[-1])]
    fig.update_layout(title="Memory reduction vs KL divergence from the full cache (lower: closer to it)",
                      xaxis_title="KV memory reduction vs full cache (x)", yaxis=yaxis, height=400)
    return fig


def pareto_figure(df, x: str = "reduction", y: str = "rel_ppl", max_rel_ppl: float | None = 0.02,
                  title: str = "Tiered KV cache: memory reduction vs perplexity increase"):
    """Every configuration of a tier sweep (hot / warm / cold: filled circles; the sliding-window
    control, rows with ``cold_mode == "drop"``: hollow diamonds), then the Pareto front over all of
    them drawn on top (line and markers: a front point that is a control shows inside its diamond),
    each front point labelled with what sets its configuration apart (:func:`short_labels`), and
    the quality threshold ``max_rel_ppl`` dashed."""
    import pandas as pd
    import plotly.graph_objects as go

    from workbench.bench.tier_eval import pareto_front

    ok = df[df["error"].isna()] if "error" in df else df
    is_control = ok["cold_mode"].eq("drop") if "cold_mode" in ok else pd.Series(False, index=ok.index)
    front = pareto_front(df, x, y)
    hover = "%{text}<br>reduction %{x:.2f}x<br>ppl %{y:+.2f}%<extra>"
    fig = go.Figure()
    for part, name, marker in ((ok[~is_control], "hot / warm / cold", TIERED_MARKER),
                               (ok[is_control], "sliding-window control (cold dropped)", CONTROL_MARKER)):
        if len(part):
            fig.add_trace(go.Scatter(x=part[x], y=100 * part[y], mode="markers", name=name, text=part["name"],
                                     marker=marker, hovertemplate=hover + name + "</extra>"))
    short = dict(zip(ok["name"], short_labels(list(ok["name"]))))
    fig.add_trace(go.Scatter(x=front[x], y=100 * front[y], mode="lines+markers+text",
                             name="Pareto front (every config)",
                             text=front["name"], customdata=[short.get(n, n) for n in front["name"]],
                             texttemplate="%{customdata}", textfont={"size": 10, "color": "#333"},
                             textposition=["top left" if i == len(front) - 1 else "top center" if i % 2 == 0
                                           else "bottom center" for i in range(len(front))], cliponaxis=False,
                             hovertemplate=hover + "Pareto front</extra>", **FRONT_STYLE))
    if max_rel_ppl is not None:
        fig.add_hline(y=100 * max_rel_ppl, line_dash="dash", annotation_text=f"+{100 * max_rel_ppl:g}% ppl",
                      annotation_position="top left")
    fig.update_layout(title=title, xaxis_title="KV memory reduction vs full cache (x)",
                      yaxis_title="perplexity change vs full cache (%)", height=420)
    return fig


def short_labels(names: list[str]) -> list[str]:
    """Configuration names without the parts every one of them shares: ``w64-s4-r8-warm64-c16-b16-
    bud64-vfull`` among others that differ only in rank, warm tokens and budget -> ``r8-warm64-bud64``
    (``base`` for a name that is all shared parts)."""
    parts = [str(n).split("-") for n in names]
    common = set.intersection(*(set(p) for p in parts)) if parts else set()
    return ["-".join(t for t in p if t not in common) or "base" for p in parts]


def _pick_text(row, on_front: bool, x: str, y: str) -> str:
    """What the picker says about one configuration: its memory and its quality, with units."""
    def num(v, fmt):
        return "—" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)

    kib = ""
    if "bytes_per_token" in row and "full_bytes_per_token" in row:
        kib = (f" ({num(row['bytes_per_token'] / 1024, '.2f')} KiB per token resident vs "
               f"{num(row['full_bytes_per_token'] / 1024, '.2f')} KiB for the full cache)")
    qual = f"perplexity {num(row[y], '+.2%')}"
    if "rel_ppl_se" in row:
        qual += f" ± {num(row['rel_ppl_se'], '.2%')}"
    if "kl" in row:
        qual += f", KL {num(row['kl'], '.4f')}"
    if "top1" in row:
        qual += f", top-1 agreement {num(row['top1'], '.1%')}"
    front = "on the Pareto front" if on_front else "not on the Pareto front"
    kind = "sliding-window control" if row.get("cold_mode") == "drop" else "hot / warm / cold"
    return (f"<b>{row['name']}</b> ({kind}, {front})<br>memory: {num(row[x], '.2f')}x less KV memory{kib}"
            f"<br>quality vs the full cache: {qual}")


def add_config_picker(fig, df, selected: str | None = None, x: str = "reduction", y: str = "rel_ppl"):
    """A dropdown over every configuration of the measured sweep ``df`` (largest ``x`` first, front
    members marked ★) on a :func:`pareto_figure`: choosing one moves a ring (a trace added last) onto
    its point and rewrites the text under the chart with its memory and perplexity.  Plotly's own
    ``updatemenus`` (``update``: restyle the ring, relayout the text), so it works in a saved
    notebook and in the report without a kernel.  ``selected``: the name shown first (default:
    the first front member).  Returns ``fig``."""
    import plotly.graph_objects as go

    from workbench.bench.tier_eval import pareto_front

    ok = (df[df["error"].isna()] if "error" in df else df).sort_values(x, ascending=False)
    if not len(ok):
        raise ValueError("add_config_picker: no configuration without an error to pick from")
    on_front = set(pareto_front(df, x, y)["name"])
    rows = [r for _, r in ok.iterrows()]
    labels = dict(zip(ok["name"], short_labels(list(ok["name"]))))
    names = [r["name"] for r in rows]
    if selected is None or selected not in names:
        selected = next((n for n in names if n in on_front), names[0])
    active = names.index(selected)
    ring = len(fig.data)
    r0 = rows[active]
    fig.add_trace(go.Scatter(x=[r0[x]], y=[100 * r0[y]], mode="markers", name="picked (menu above)",
                             text=[r0["name"]], marker={"symbol": "circle-open", "size": 24, "color": "#000000",
                                                        "line": {"width": 3}},
                             hovertemplate="picked: %{text}<extra></extra>"))
    fig.add_annotation(text="pick a configuration →", xref="paper",
                       yref="paper", x=0, y=1.02, xanchor="left", yanchor="bottom", showarrow=False,
                       font={"size": 12, "color": "#444"}, yshift=8)
    note = len(fig.layout.annotations)
    fig.add_annotation(text=_pick_text(r0, r0["name"] in on_front, x, y), xref="paper", yref="paper", x=0, y=-0.2,
                       xanchor="left", yanchor="top", showarrow=False, align="left", font={"size": 12},
                       bgcolor="rgba(255,255,255,0.9)", bordercolor="#999", borderwidth=1, borderpad=6)
    buttons = [{"label": f"{'★ ' if r['name'] in on_front else ''}{labels[r['name']]}  ({r[x]:.2f}x, {r[y]:+.2%})",
                "method": "update",
                "args": [{"x": [[r[x]]], "y": [[100 * r[y]]], "text": [[r["name"]]]},
                         {f"annotations[{note}].text": _pick_text(r, r["name"] in on_front, x, y)}, [ring]]}
               for r in rows]
    margin = fig.layout.margin.to_plotly_json() if fig.layout.margin else {}
    fig.update_layout(
        updatemenus=[{"type": "dropdown", "buttons": buttons, "active": active, "x": 1.0, "xanchor": "right",
                      "y": 1.02, "yanchor": "bottom", "showactive": True, "pad": {"b": 4}}],
        margin={**margin, "t": max(margin.get("t") or 0, 90), "b": max(margin.get("b") or 0, 150),
                "r": max(margin.get("r") or 0, 230)},
        height=(fig.layout.height or 420) + 110,
        legend={"x": 1.02, "y": 1.0, "yanchor": "top", "xanchor": "left"})
    fig.update_layout(title={"x": 0.01, "xanchor": "left", "y": 0.98, "yanchor": "top"})
    return fig
