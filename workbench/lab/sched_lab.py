"""Notebook 04's load section, its views: the load ramp with a live dashboard on its guarded run
(:func:`load_ramp`; the ramp itself, a measurement, is
:func:`workbench.bench.sched_experiments.load_ramp`) and the figure of the micro-batch window
sweep.  The scheduler's measurements are in :mod:`workbench.bench.sched_experiments` and
:mod:`workbench.bench.sched`.
"""

from __future__ import annotations

from workbench.bench import sched_experiments as sx


def load_ramp(llm, stages, warm: float, max_tokens: int = 16, window_ms: float = 0.0, seed: int = 3,
              guard_config: dict | None = None, dashboard: bool = True, max_num_seqs: int = 16,
              max_num_batched_tokens: int = 256, live: bool = True) -> dict:
    """:func:`workbench.bench.sched_experiments.load_ramp` (the same ramp without and with the SLO
    guard; see there for what it returns) with a :class:`~workbench.lab.load_views.LatencyDashboard`
    attached to the guarded run when ``dashboard``; with ``live`` too it is displayed before the run
    starts (a notebook run by hand), without it nothing is displayed and
    ``dashboard.static_figure()`` is the record (a batch run)."""
    def watch(run, target, guard):
        from workbench.lab.load_views import LatencyDashboard

        dash = LatencyDashboard(metrics_fn=target.metrics, guard=guard, title="ramp with the SLO guard").attach(run)
        if live:
            dash.display()
        return dash

    return sx.load_ramp(llm, stages, warm, max_tokens=max_tokens, window_ms=window_ms, seed=seed,
                        guard_config=guard_config, max_num_seqs=max_num_seqs,
                        max_num_batched_tokens=max_num_batched_tokens, watch=watch if dashboard else None)


def window_sweep_figure(table, rate: float):
    """The micro-batch window sweep: queue wait and TTFT P95 (ms, left axis) and the mean batch
    size (right axis) against the window.  ``table``: indexed by ``window_ms`` with columns
    ``queue_ms_p95``, ``ttft_ms_p95``, ``mean_batch``.  Both axes start at 0 (a change of a few
    percent between single replays is not drawn as a cliff), the x ticks are the windows
    measured, and the right axis has ticks of its own (a secondary axis otherwise takes the
    left axis's tick positions: 3.924, 4.002, ...)."""
    from plotly.subplots import make_subplots

    windows = [float(w) for w in table.index]
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    for col, name, color in (("queue_ms_p95", "queue wait P95", "#0072B2"), ("ttft_ms_p95", "TTFT P95", "#E69F00")):
        fig.add_scatter(x=windows, y=table[col].tolist(), name=name, mode="lines+markers", line=dict(color=color),
                        hovertemplate=f"window %{{x:g}} ms: {name} %{{y:.1f}} ms<extra></extra>")
    fig.add_scatter(x=windows, y=table["mean_batch"].tolist(), name="mean batch size (right axis)",
                    mode="lines+markers", line=dict(color="#009E73", dash="dot"), secondary_y=True,
                    hovertemplate="window %{x:g} ms: mean batch %{y:.2f}<extra></extra>")
    top = max(1.0, float(table["mean_batch"].max()))
    fig.update_yaxes(title_text="ms", rangemode="tozero", secondary_y=False)
    fig.update_yaxes(title_text="mean batch size (sequences)", tickmode="auto", nticks=6, tickformat="~g",
                     range=[0, 1.15 * top], showgrid=False, secondary_y=True)
    fig.update_xaxes(title_text="micro-batch window (ms)", tickmode="array", tickvals=windows,
                     ticktext=[f"{w:g}" for w in windows])
    fig.update_layout(title=f"micro-batch window sweep at {rate:g} requests/s (one replay per window)", height=400,
                      margin=dict(l=60, r=70, t=80, b=50),
                      legend=dict(orientation="h", x=0, xanchor="left", y=1.02, yanchor="bottom"))
    return fig
