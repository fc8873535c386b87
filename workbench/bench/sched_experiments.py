"""The experiments of notebook 04 (the scheduler) that are measurements, not views.

* :func:`summary_row`: one replay of a trace as a row (TTFT, queue wait, ITL percentiles, mean
  batch, steps, tokens/s), what a ``mode="point"`` sweep point records;
* :func:`preemption_experiment`: low-priority requests fill a small KV pool, high-priority ones
  arrive, once per preemption mode; per request its priority, preemptions, TTFT and E2E, and its
  tokens next to the tokens it gets when run alone;
* :func:`window_rate_sweep`: the trace at a few arrival rates under a few micro-batch windows, one
  replay per point, each with its engine steps (the timeline a learner picks in the notebook);
* :func:`ramp_stages`, :func:`load_ramp`: a k6-style ramp against the engine, without and with the
  server's SLO guard (its live dashboard is attached by :func:`workbench.lab.sched_lab.load_ramp`).
"""

from __future__ import annotations

import numpy as np

from workbench.engine.core import LLMEngine
from workbench.kv import PagedKVConfig
from workbench.sched.config import SchedulerConfig

LOAD_TABLE_COLUMNS = ["requests", "ok", "rejected", "offered_qps", "goodput_qps", "ttft_p50_ms", "ttft_p95_ms",
                      "ttft_p99_ms"]
SUMMARY_COLUMNS = ("TTFT p50 ms", "TTFT p95 ms", "queue p95 ms", "ITL p95 ms", "mean batch", "steps", "tokens/s")


def summary_row(res, **label) -> dict:
    """One replay (``workbench.engine.replay``'s result: ``outputs``, ``steps``, ``tokens_per_s``)
    as a row: ``label``'s items first, then TTFT p50 / p95, queue-wait p95 and inter-token-latency
    p95 in ms over every request (every gap of every request for the ITL), the mean number of
    sequences in the steps that computed any, the number of such steps, and tokens/s."""
    outs = res.outputs
    if not outs:
        raise ValueError("summary_row: the replay has no outputs")
    ttft = [o.metrics.ttft * 1e3 for o in outs]
    queue = [o.metrics.time_in_queue * 1e3 for o in outs]
    itl = [g * 1e3 for o in outs for g in o.metrics.itl]
    busy = res.steps[res.steps["num_seqs"] > 0]
    return {**label, "TTFT p50 ms": np.percentile(ttft, 50), "TTFT p95 ms": np.percentile(ttft, 95),
            "queue p95 ms": np.percentile(queue, 95), "ITL p95 ms": np.percentile(itl, 95) if itl else float("nan"),
            "mean batch": busy["num_seqs"].mean(), "steps": len(busy), "tokens/s": res.tokens_per_s}


def preemption_experiment(llm, prompts, params, modes=("recompute", "swap"), low: int = 4, warm_steps: int = 4,
                          block_size: int = 16, num_blocks: int = 16, max_num_seqs: int = 8,
                          max_num_batched_tokens: int = 256, high_priority: int = 5, progress=None) -> dict:
    """Preemption on a small pool, once per mode of ``modes`` (``SchedulerConfig.preemption_mode``).

    Each prompt is first run alone on a plain engine (its reference tokens).  Then, per mode, a
    batched engine with a pool of ``num_blocks`` blocks of ``block_size`` admits the first ``low``
    prompts at priority 0, steps ``warm_steps`` times, adds the rest at ``high_priority`` and runs
    until every request finishes.

    Returns a dict:

    * ``alone``: each prompt's tokens run alone;
    * ``tokens``: mode -> each request's tokens (in prompt order);
    * ``used_blocks``: mode -> blocks still in use after every request was released (0 expected);
    * ``steps``: mode -> the engine's ``steps_frame()``;
    * ``rows``: one dict per (mode, request): ``mode``, ``request``, ``priority``,
      ``preemptions``, ``TTFT ms``, ``E2E ms``.

    Nothing is asserted: equality with ``alone`` and the preemption counts are the caller's checks.
    ``progress`` (a Progress of ``1 + len(modes)`` parts, or None): told "alone" and each mode."""
    if not 0 < low < len(prompts):
        raise ValueError(f"preemption_experiment: low={low} must leave at least one prompt of {len(prompts)} "
                         "for the high-priority arrivals")
    if progress is not None:
        progress.start(f"each of the {len(prompts)} prompts alone (the reference tokens)")
    alone = [LLMEngine(llm).generate([p], params)[0].token_ids for p in prompts]
    if progress is not None:
        progress.advance()
    out = {"alone": alone, "tokens": {}, "used_blocks": {}, "steps": {}, "rows": []}
    for mode in modes:
        if progress is not None:
            progress.start(f"preemption_mode={mode!r}")
        eng = LLMEngine(llm, kv=PagedKVConfig(block_size=block_size, num_blocks=num_blocks),
                        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                  max_num_batched_tokens=max_num_batched_tokens,
                                                  preemption_mode=mode))
        ids = [eng.add_request(p, params, priority=0) for p in prompts[:low]]
        for _ in range(warm_steps):
            eng.step()
        ids += [eng.add_request(p, params, priority=high_priority) for p in prompts[low:]]
        while eng.has_unfinished():
            eng.step()
        outs = [eng.release(r) for r in ids]
        out["tokens"][mode] = [o.token_ids for o in outs]
        out["used_blocks"][mode] = eng.pool.manager.num_used_blocks
        out["steps"][mode] = eng.steps_frame()
        for o in outs:
            out["rows"].append({"mode": mode, "request": o.request_id, "priority": o.priority,
                                "preemptions": o.num_preemptions, "TTFT ms": o.metrics.ttft * 1e3,
                                "E2E ms": o.metrics.e2e * 1e3})
        if progress is not None:
            progress.advance()
    return out


def busy_steps(frame):
    """The steps of ``frame`` (``LLMEngine.steps_frame()``) worth drawing: those that computed
    something, and idle ones where the queue length changed (a micro-batch window spins the engine
    through thousands of empty steps while it holds requests: 9,198 steps for a 3 s trace at 20 ms;
    the queue they show is kept, the rest dropped).  Index reset."""
    if len(frame) == 0:
        return frame.reset_index(drop=True)
    keep = frame["num_seqs"] > 0
    if "waiting" in frame.columns:
        keep |= frame["waiting"].ne(frame["waiting"].shift())
    return frame[keep].reset_index(drop=True)


# ---- the micro-batch window x arrival rate sweep ------------------------------------------------------
def window_rate_sweep(llm, cfg, windows_ms, rates, progress=None) -> list[dict]:
    """The trace of ``cfg`` (:func:`workbench.bench.sched.mixed_trace`: the same prompts) at each
    arrival rate of ``rates``, replayed under each micro-batch window of ``windows_ms``: one
    real-time replay per point (:func:`workbench.bench.sched.trace_run`).  Returns one row per
    point: ``window_ms``, ``rate``, the trace row's columns (TTFT, queue wait, ITL percentiles in
    ms, ``mean_batch``, ``steps``, ``tokens_per_s``, ``tokens``) and ``steps_frame`` (the engine's
    steps that computed something or changed the queue: a window spins the engine through many
    empty steps).  ``progress``: told each point's name as it starts and each end."""
    from dataclasses import replace

    from workbench.bench.sched import mixed_trace, trace_run

    rows = []
    for rate in rates:
        trace = mixed_trace(llm, replace(cfg, rate=float(rate)))
        for w in windows_ms:
            if progress is not None:
                progress.start(f"window {w:g} ms at {rate:g} req/s")
            row = trace_run(llm, cfg, trace, label={"window_ms": float(w), "rate": float(rate)}, steps=True,
                            micro_batch_window_s=float(w) / 1e3)
            row["steps_frame"] = busy_steps(row["steps_frame"])
            rows.append(row)
            if progress is not None:
                progress.advance()
    return rows


# ---- the load ramp, without and with the SLO guard ------------------------------------------------
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
    return warm, peak, [(d_warm, warm, "warm"), (d_ramp, peak, "ramp"), (d_peak, peak, "peak"),
                        (d_cool, 0.0, "cool-down")]


def load_ramp(llm, stages, warm: float, max_tokens: int = 16, window_ms: float = 0.0, seed: int = 3,
              guard_config: dict | None = None, max_num_seqs: int = 16, max_num_batched_tokens: int = 256,
              watch=None, progress=None) -> dict:
    """The same ramp twice on one engine (``AsyncEngine`` behind an ``EngineTarget``): without a
    guard, then behind an :class:`~workbench.serve.slo.SLOGuard` (``guard_config``: SLOConfig
    fields; default factor 2, window 20, 8 samples, 1 s cool-down, 3 probes).  ``watch(run,
    target, guard)``, if given, is called before *each* run starts (``guard`` is None for the run
    without one; a live view attaches itself to the ``LoadRun`` there); what it returns is that
    run's view, and a view with a ``finish()`` method has it called when its run ends.
    ``progress`` (a :class:`~workbench.lab.progress.Progress` of 2 "ramps", or None): told which
    run goes and, while it goes, its stage, time and counts.  The target is closed at the end.

    Returns a dict: ``plain`` and ``guarded`` (the ``LoadResult`` of each run), ``guard``,
    ``target`` (its ``engine`` keeps every step: ``target.engine.steps_frame()``), ``views``
    (run name -> what ``watch`` returned, or None), ``dashboard`` (the guarded run's view) and
    ``load_table``: :data:`LOAD_TABLE_COLUMNS` of both runs' summaries, indexed by (run, stage)."""
    import pandas as pd

    from workbench.load import EngineTarget, LoadConfig, LoadRun
    from workbench.serve.slo import GuardedTarget, SLOConfig, SLOGuard

    load_cfg = dict(mode="poisson", rate=warm, stages=stages, max_tokens=max_tokens, seed=seed,
                    sampling={"temperature": 0.0})
    target = EngineTarget(LLMEngine(llm, scheduler=SchedulerConfig(max_num_seqs=max_num_seqs,
                                                                   max_num_batched_tokens=max_num_batched_tokens,
                                                                   micro_batch_window_s=float(window_ms) / 1e3)))
    views: dict = {}

    def one(name: str, run_target, guard):
        run = LoadRun(run_target, LoadConfig(**load_cfg, name=name))
        if progress is not None:
            progress.start(name)
            run.add_observer(lambda r, rec: progress.note(
                f"stage {r.stage_name} at {r.elapsed():.1f} s: sent {r.sent}, ok {r.counts['ok']}, "
                f"rejected {r.counts['rejected']}, in flight {r.in_flight}"))
        views[name] = watch(run, target, guard) if watch is not None else None
        res = run.run()
        if views[name] is not None and callable(getattr(views[name], "finish", None)):
            views[name].finish()
        if progress is not None:
            progress.advance()
        return res

    try:
        plain = one("no guard", target, None)
        guard = SLOGuard(SLOConfig(**({"factor": 2.0, "window": 20, "min_samples": 8, "cooldown_s": 1.0, "probes": 3}
                                      | (guard_config or {}))))
        guarded = one("SLO guard", GuardedTarget(target, guard), guard)
    finally:
        target.close()
    load_table = pd.concat({"no guard": plain.summary()[LOAD_TABLE_COLUMNS],
                            "SLO guard": guarded.summary()[LOAD_TABLE_COLUMNS]})
    return {"plain": plain, "guarded": guarded, "guard": guard, "target": target, "views": views,
            "dashboard": views["SLO guard"], "load_table": load_table}
