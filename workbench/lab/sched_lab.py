"""Notebook 04's load section: a k6-style ramp against the engine, without and with the SLO guard;
and the figure of its micro-batch window sweep.

It drives the server's SLO guard (``workbench.serve.slo``) and a live dashboard
(:class:`workbench.lab.load_views.LatencyDashboard`), so it lives in ``lab``; the scheduler's
measurements are in :mod:`workbench.bench.sched_experiments` and :mod:`workbench.bench.sched`.
"""

from __future__ import annotations

LOAD_TABLE_COLUMNS = ["requests", "ok", "rejected", "offered_qps", "goodput_qps", "ttft_p50_ms", "ttft_p95_ms",
                      "ttft_p99_ms"]


def ramp_stages(capacity: float, warm_frac: float = 0.3, peak_frac: float = 2.5, peak_cap: float = 200.0,
                durations=(3.0, 2.0, 4.0, 3.0)) -> tuple[float, float, list[tuple[float, float, str]]]:
    """The ramp sized from a measured ``capacity`` (requests/s): a warm stage at ``warm_frac`` of
    it, a ramp to and a plateau at ``peak_frac`` of it (at most ``peak_cap``), then a cool-down
    at rate 0.  Returns ``(warm, peak, stages)`` with stages ``(seconds, rate, name)`` as
    ``LoadConfig(stages=...)`` takes them; rates rounded to 0.1."""
    if not capacity > 0:
        raise ValueError(f"ramp_stages: capacity must be > 0 requests/s, got {capacity!r}")
    warm, peak = round(warm_frac * capacity, 1), round(min(peak_frac * capacity, peak_cap), 1)
    d_warm, d_ramp, d_peak, d_cool = durations
    return warm, peak, [(d_warm, warm, "warm"), (d_ramp, peak, "ramp"), (d_peak, peak, "peak"), (d_cool, 0.0, "cool-down")]


def load_ramp(llm, stages, warm: float, max_tokens: int = 16, window_ms: float = 0.0, seed: int = 3,
              guard_config: dict | None = None, dashboard: bool = True, max_num_seqs: int = 16,
              max_num_batched_tokens: int = 256, live: bool = True) -> dict:
    """The same ramp twice on one engine (``AsyncEngine`` behind an ``EngineTarget``): without a
    guard, then behind an :class:`~workbench.serve.slo.SLOGuard` (``guard_config``: SLOConfig
    fields; default factor 2, window 20, 8 samples, 1 s cool-down, 3 probes).  With
    ``dashboard`` a :class:`~workbench.lab.load_views.LatencyDashboard` is attached to the
    guarded run; with ``live`` too it is displayed before the run starts (a notebook run by
    hand), without it nothing is displayed and ``dashboard.static_figure()`` is the record
    (a batch run).  The target is closed at the end.

    Returns a dict: ``plain`` and ``guarded`` (the ``LoadResult`` of each run), ``guard``,
    ``target`` (its ``engine`` keeps every step: ``target.engine.steps_frame()``), ``dashboard``
    (or None) and ``load_table``: :data:`LOAD_TABLE_COLUMNS` of both runs' summaries, indexed by
    (run, stage)."""
    import pandas as pd

    from workbench.engine.core import LLMEngine
    from workbench.load import EngineTarget, LoadConfig, LoadRun
    from workbench.sched import SchedulerConfig
    from workbench.serve.slo import GuardedTarget, SLOConfig, SLOGuard

    load_cfg = dict(mode="poisson", rate=warm, stages=stages, max_tokens=max_tokens, seed=seed,
                    sampling={"temperature": 0.0})
    target = EngineTarget(LLMEngine(llm, scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                                   max_num_batched_tokens=max_num_batched_tokens,
                                                                   micro_batch_window_s=float(window_ms) / 1e3)))
    try:
        plain = LoadRun(target, LoadConfig(**load_cfg, name="no guard")).run()
        guard = SLOGuard(SLOConfig(**({"factor": 2.0, "window": 20, "min_samples": 8, "cooldown_s": 1.0, "probes": 3}
                                      | (guard_config or {}))))
        run = LoadRun(GuardedTarget(target, guard), LoadConfig(**load_cfg, name="SLO guard"))
        dash = None
        if dashboard:
            from workbench.lab.load_views import LatencyDashboard

            dash = LatencyDashboard(metrics_fn=target.metrics, guard=guard, title="ramp with the SLO guard").attach(run)
            if live:
                dash.display()
        guarded = run.run()
    finally:
        target.close()
    load_table = pd.concat({"no guard": plain.summary()[LOAD_TABLE_COLUMNS],
                            "SLO guard": guarded.summary()[LOAD_TABLE_COLUMNS]})
    return {"plain": plain, "guarded": guarded, "guard": guard, "target": target, "dashboard": dash,
            "load_table": load_table}


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
