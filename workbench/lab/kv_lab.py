"""Notebook 02's views (KV tiers) that are not block maps (those are in :mod:`workbench.lab.kv_view`).

* :func:`pca_figure`: explained variance of PCA bases of keys: the mean curve per key space, and
  per layer and KV head at one rank, before vs after RoPE;
* :func:`kl_figure`: memory reduction vs KL to the full cache, tiered configurations vs the
  sliding-window control.

The data come from :mod:`workbench.bench.kv_experiments` and :mod:`workbench.bench.tier_eval`.
"""

from __future__ import annotations

KEY_SPACE_DASH = (("post_rope", "solid"), ("pre_rope", "dash"))


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
                        subplot_titles=["mean over layers and heads", f"post-RoPE, rank {rank}", f"pre-RoPE, rank {rank}"])
    for ks, dash in KEY_SPACE_DASH:
        fig.add_trace(go.Scatter(x=mean_ev.index, y=mean_ev[ks], name=ks, line_dash=dash), row=1, col=1)
    for col, ks in ((2, "post_rope"), (3, "pre_rope")):
        grid = bases[ks].explained(rank).numpy()                       # [layers, kv heads]
        fig.add_trace(go.Heatmap(z=grid, zmin=0, zmax=1, colorscale="Viridis", showscale=col == 3,
                                 x=[f"kv{h}" for h in range(grid.shape[1])], y=[f"L{l}" for l in range(grid.shape[0])],
                                 hovertemplate="%{y} %{x}: %{z:.1%}<extra>" + ks + "</extra>"), row=1, col=col)
    fig.update_xaxes(title_text="rank", row=1, col=1)
    fig.update_yaxes(title_text="explained variance", row=1, col=1)
    fig.update_layout(title=f"PCA of keys ({bases['post_rope'].num_tokens:,} tokens): explained variance", height=400,
                      legend=dict(orientation="h", x=0, y=-0.25))
    return fig


def kl_figure(tiered, control):
    """Memory reduction (x) vs KL(full || tiered) (log scale), one marker per configuration:
    ``tiered`` (hot / warm / cold, circles) and ``control`` (the sliding-window control, crosses),
    both rows of a tier sweep with ``name``, ``reduction`` and ``kl``."""
    import plotly.graph_objects as go

    fig = go.Figure([go.Scatter(x=part["reduction"], y=part["kl"], mode="markers", name=label, text=part["name"],
                                marker=dict(symbol=sym, size=9),
                                hovertemplate="%{text}<br>%{x:.2f}x, KL %{y:.4f}<extra></extra>")
                     for part, label, sym in ((tiered, "hot / warm / cold", "circle"), (control, "sliding-window control", "x"))])
    fig.update_layout(title="Memory reduction vs KL to the full cache (nats per token)", xaxis_title="KV memory reduction (x)",
                      yaxis_title="KL(full || tiered)", yaxis_type="log", height=380)
    return fig
