"""Notebook 03's sweep figures: throughput, hit rate and efficiency against the prefetch distance
(:func:`distance_sweep_figure`), throughput against the resident fraction of the weights
(:func:`resident_fraction_figure`) and transfer bandwidth against the block size
(:func:`block_size_figure`).  Rows may be dicts, dataclasses or a DataFrame; missing values are
skipped.  The live timeline is :mod:`workbench.lab.prefetch_view`."""

from __future__ import annotations

import dataclasses
import html
import math

from workbench.lab.prefetch_view import LAYER_COLORS, _fmt_bytes


def _records(rows) -> list[dict]:
    if hasattr(rows, "to_dict") and hasattr(rows, "columns"):
        rows = rows.to_dict("records")
    out = []
    for r in rows or []:
        d = dataclasses.asdict(r) if dataclasses.is_dataclass(r) else dict(r if isinstance(r, dict) else vars(r))
        out.append({k: v for k, v in d.items() if not (isinstance(v, float) and math.isnan(v))})
    return out


def _error_y(rows: list[dict], key: str, lo: str | None = None, hi: str | None = None) -> dict | None:
    """Asymmetric error bars from ``key``_min / ``key``_max (or ``lo`` / ``hi``); None without them."""
    lo, hi = lo or f"{key}_min", hi or f"{key}_max"
    if not any(r.get(lo) is not None or r.get(hi) is not None for r in rows):
        return None
    return dict(type="data", symmetric=False, thickness=1.2, width=4,
                array=[max(0.0, r[hi] - r[key]) if r.get(hi) is not None else None for r in rows],
                arrayminus=[max(0.0, r[key] - r[lo]) if r.get(lo) is not None else None for r in rows])


def _empty(fig, text: str):
    fig.add_annotation(text=text, xref="paper", yref="paper", x=0.5, y=0.5, showarrow=False,
                       font=dict(size=14, color="gray"))
    return fig


def _rate_traces(fig, go, rows: list[dict], x: list) -> None:
    """Hit rate and efficiency (%) on the secondary axis, where the rows have them."""
    for key, name, dash in (("prefetch_hit_rate", "prefetch hit rate", "dot"),
                            ("prefetch_efficiency", "prefetch efficiency", "dash")):
        pts = [(xv, r[key] * 100) for xv, r in zip(x, rows) if r.get(key) is not None]
        if pts:
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                                     name=name, line=dict(dash=dash), marker=dict(size=7),
                                     hovertemplate=name + " %{y:.0f}%<extra></extra>"), secondary_y=True)


def _two_axis_layout(fig, title: str, x_title: str, has_rates: bool) -> None:
    fig.update_layout(title=dict(text=title, x=0.01), height=400, margin=dict(l=60, r=60, t=50, b=50),
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0),
                      hovermode="x unified")
    fig.update_xaxes(title_text=x_title)
    fig.update_yaxes(title_text="tokens / s", rangemode="tozero", secondary_y=False)
    if has_rates:
        fig.update_yaxes(title_text="hit rate / efficiency (%)", range=[0, 105], dtick=20, showgrid=False,
                         secondary_y=True)


def distance_sweep_figure(rows, title: str = "Prefetch distance: throughput, hit rate, efficiency"):
    """tokens/s per prefetch distance (bars, min..max as error bars) with the prefetch hit rate and
    efficiency (%) on a second axis.  Rows: ``distance`` and/or ``config`` (the x label),
    ``tokens_per_s``; optional ``tokens_per_s_min/_max``, ``prefetch_hit_rate``,
    ``prefetch_efficiency``."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = [r for r in _records(rows) if r.get("tokens_per_s") is not None]
    rows.sort(key=lambda r: (r.get("distance", math.inf), str(r.get("config", ""))))
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    if not rows:
        return _empty(fig.update_layout(title=title, height=400), "no rows")
    x = [str(r.get("config", f"d={r.get('distance')}")) for r in rows]
    fig.add_trace(go.Bar(x=x, y=[r["tokens_per_s"] for r in rows], name="tokens / s", marker_color="#4c78a8",
                         error_y=_error_y(rows, "tokens_per_s"), opacity=0.85,
                         hovertemplate="%{x}: %{y:.1f} tokens/s<extra></extra>"), secondary_y=False)
    _rate_traces(fig, go, rows, x)
    has_rates = len(fig.data) > 1
    _two_axis_layout(fig, title, "prefetch distance" if all("distance" in r for r in rows) else "config", has_rates)
    fig.update_xaxes(type="category")
    return fig


def resident_fraction_figure(rows, title: str = "Throughput vs resident fraction of the weights"):
    """tokens/s against the resident fraction (x in %, one line per ``distance`` when rows have
    several), min..max error bars, hit rate / efficiency (%) on a second axis when present."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    rows = [r for r in _records(rows) if r.get("tokens_per_s") is not None and r.get("resident_fraction") is not None]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    if not rows:
        return _empty(fig.update_layout(title=title, height=400), "no rows")
    groups: dict = {}
    for r in sorted(rows, key=lambda r: r["resident_fraction"]):
        groups.setdefault(r.get("distance"), []).append(r)
    for gi, (d, sub) in enumerate(sorted(groups.items(), key=lambda kv: (kv[0] is None, kv[0] or 0))):
        name = "tokens / s" if len(groups) == 1 or d is None else f"tokens / s, d={d}"
        fig.add_trace(go.Scatter(x=[r["resident_fraction"] * 100 for r in sub], y=[r["tokens_per_s"] for r in sub],
                                 mode="lines+markers", name=name, error_y=_error_y(sub, "tokens_per_s"),
                                 line=dict(color=LAYER_COLORS[gi % len(LAYER_COLORS)], width=2),
                                 text=[str(r.get("config", "")) for r in sub],
                                 hovertemplate="%{text} resident %{x:.0f}%: %{y:.1f} tokens/s<extra></extra>"),
                      secondary_y=False)
    n_tok = len(fig.data)
    if len(groups) == 1:                 # several distances: the rates would need a line each; skip
        _rate_traces(fig, go, rows, [r["resident_fraction"] * 100 for r in rows])
    _two_axis_layout(fig, title, "resident share of the weights (%)", len(fig.data) > n_tok)
    fig.update_xaxes(range=[-3, 103], ticksuffix="%")
    return fig


def block_size_figure(points, title: str = "Transfer bandwidth vs block size"):
    """Achieved GB/s (median, min..max error bars) against the block size on a log-2 x axis with
    byte-unit ticks (8 KiB, 64 KiB, ...), one line per ``transport``.  Points: dicts or
    dataclasses with ``transport, block_bytes, gbps_median`` (``gbps_min/_max`` optional)."""
    import plotly.graph_objects as go

    pts = [p for p in _records(points) if p.get("block_bytes") and p.get("gbps_median") is not None]
    fig = go.Figure()
    fig.update_layout(title=dict(text=title, x=0.01), height=400, margin=dict(l=60, r=20, t=50, b=50),
                      yaxis=dict(title="GB/s", rangemode="tozero"), hovermode="closest",
                      legend=dict(orientation="h", yanchor="bottom", y=1.0, xanchor="right", x=1.0))
    if not pts:
        return _empty(fig, "no points")
    groups: dict = {}
    for p in sorted(pts, key=lambda p: p["block_bytes"]):
        groups.setdefault(str(p.get("transport", "")), []).append(p)
    for gi, (name, sub) in enumerate(groups.items()):
        err = _error_y(sub, "gbps_median", "gbps_min", "gbps_max")
        fig.add_trace(go.Scatter(x=[p["block_bytes"] for p in sub], y=[p["gbps_median"] for p in sub],
                                 mode="lines+markers", name=name or "transfer", error_y=err,
                                 line=dict(color=LAYER_COLORS[gi % len(LAYER_COLORS)], width=2),
                                 text=[_fmt_bytes(p["block_bytes"]) for p in sub],
                                 hovertemplate=f"{html.escape(name)} %{{text}}: %{{y:.2f}} GB/s<extra></extra>"))
    lo, hi = min(p["block_bytes"] for p in pts), max(p["block_bytes"] for p in pts)
    e0, e1 = math.floor(math.log2(lo)), math.ceil(math.log2(hi))
    stride = max(1, math.ceil((e1 - e0 + 1) / 8))           # at most ~8 ticks, so labels never overlap
    ticks = [2 ** e for e in range(e0, e1 + 1) if (e - e0) % stride == 0]
    fig.update_xaxes(type="log", title_text="block size", tickvals=ticks, ticktext=[_fmt_bytes(t) for t in ticks],
                     range=[math.log10(lo) - 0.15, math.log10(hi) + 0.15])
    return fig
