"""Measure what the batched engine buys, side by side in one run (``workbench sched-bench``).

Four experiments on one loaded model, each comparing configurations on the same prompts:

* **throughput**: N concurrent greedy streams through the batched engine vs the same N
  requests run one after another on the same engine; output tokens/s and their ratio, with the
  greedy tokens compared (they must be identical: batch invariance).  Runs are interleaved
  (sequential, concurrent, concurrent, sequential, ...) so machine drift hits both;
* **chunked prefill**: one seeded Poisson trace of short prompts with a long one every k-th,
  replayed in real time with chunked prefill on and off under the same token budget; TTFT
  P50/P95 and inter-token P95.  Without chunking a long prompt occupies a whole step and the
  running streams stall behind it;
* **micro-batch window**: the same trace under several admission windows; queue wait, TTFT,
  mean batch size and steps taken.  A window trades a little queueing for larger batches;
* **scheduler overhead**: steps with a full batch (``overhead_batch`` running sequences):
  the time in :meth:`Scheduler.schedule` (pure Python) and in the post-step bookkeeping as a
  share of the whole step.

After each experiment, and each row of the trace experiments, the result so far goes to
:func:`workbench.measure.gpu_results.save_partial` (a no-op unless ``$WORKBENCH_PARTIAL_OUT`` is
set; the device check's ``sched_bench`` step keeps it when its time cap stops the run).

Every number is measured here, on this machine; nothing is extrapolated.
"""

from __future__ import annotations

import statistics
import sys
import time
from dataclasses import asdict

import numpy as np

from workbench.bench.sched_config import SchedBenchConfig  # noqa: F401 - its home: torch-free, for the CLI
from workbench.engine.llm import LLM
from workbench.errors import ConfigError
from workbench.measure.agreement import agreement
from workbench.measure.compare import compare_samples
from workbench.engine.sampling import SamplingParams
from workbench.sched.config import SchedulerConfig
from workbench.engine.core import LLMEngine
from workbench.engine.traces import Trace, replay


def _prompts(llm: LLM, n: int, length: int, seed: int) -> list[list[int]]:
    from workbench.data import heldout_token_windows

    return heldout_token_windows(llm.tokenizer, n, length, seed=seed)


def _pct(values, q) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.percentile(v, q)) if v else None


def _engine(llm: LLM, cfg: SchedBenchConfig, **sched) -> LLMEngine:
    return LLMEngine(llm, scheduler=SchedulerConfig(**sched), batch_invariant=cfg.batch_invariant)


# ---- 1. throughput ----------------------------------------------------------------------------
def throughput(llm: LLM, cfg: SchedBenchConfig, progress=None) -> dict:
    """N concurrent greedy streams vs the same requests one after another (see the module doc).
    ``progress`` (a Progress of ``2 * cfg.rounds`` runs, or None): told each run as it starts."""
    prompts = _prompts(llm, cfg.streams, cfg.prompt_tokens, cfg.seed)
    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=True)
    eng = _engine(llm, cfg, max_num_seqs=max(cfg.streams, 1), max_num_batched_tokens=max(512, cfg.prompt_tokens))
    eng.generate(prompts[:1], params)                            # warm-up
    runs = {"sequential": [], "concurrent": []}
    tokens = {}
    order = ["sequential", "concurrent", "concurrent", "sequential"] * cfg.rounds
    for k, mode in enumerate(order[: 2 * cfg.rounds]):
        if progress is not None:
            progress.start(f"{mode}, run {sum(1 for m in order[:k + 1] if m == mode)}/{cfg.rounds}")
        t0 = time.perf_counter()
        outs = [eng.generate([p], params)[0] for p in prompts] if mode == "sequential" \
            else eng.generate(prompts, params)
        wall = time.perf_counter() - t0
        n = sum(len(o.token_ids) for o in outs)
        runs[mode].append(n / wall)
        tokens.setdefault(mode, [o.token_ids for o in outs])
        if progress is not None:
            progress.advance()
    steps = eng.steps_frame()
    seq_tps, conc_tps = statistics.median(runs["sequential"]), statistics.median(runs["concurrent"])
    cmp = compare_samples(runs["concurrent"], runs["sequential"], names=("concurrent", "sequential"),
                          metric="output tokens/s", lower_is_better=False, better_word="faster")
    return {"streams": cfg.streams, "batch_invariant": eng.runner.batch_invariant,
            "sequential_tokens_per_s": seq_tps, "concurrent_tokens_per_s": conc_tps,
            "speedup": conc_tps / seq_tps, "runs": runs, "verdict": cmp.verdict, "winner": cmp.winner,
            "identical_tokens": tokens["sequential"] == tokens["concurrent"],
            "token_agreement": agreement(tokens["sequential"], tokens["concurrent"])["rate"],
            "max_batch": int(steps["num_seqs"].max())}


# ---- 2 and 3. traces --------------------------------------------------------------------------
def mixed_trace(llm: LLM, cfg: SchedBenchConfig) -> Trace:
    """Short prompts with a long one every ``long_every``-th, Poisson arrivals (seeded)."""
    n_long = (cfg.trace_requests + cfg.long_every - 1) // cfg.long_every
    short = _prompts(llm, cfg.trace_requests, cfg.prompt_tokens, cfg.seed + 1)
    long = _prompts(llm, n_long, cfg.long_prompt_tokens, cfg.seed + 2)
    prompts = [long[i // cfg.long_every] if i % cfg.long_every == cfg.long_every - 1 else short[i]
               for i in range(cfg.trace_requests)]
    params = SamplingParams(temperature=0.0, max_tokens=cfg.max_tokens, ignore_eos=True)
    return Trace.poisson(prompts, cfg.rate, cfg.trace_requests, params, seed=cfg.seed)


def _trace_row(res, cfg: SchedBenchConfig, **label) -> dict:
    long_len = cfg.long_prompt_tokens
    outs = res.outputs
    ttft = [o.metrics.ttft * 1e3 for o in outs if o.metrics.ttft is not None]
    short_ttft = [o.metrics.ttft * 1e3 for o in outs if o.metrics.ttft is not None
                  and len(o.prompt_token_ids) < long_len]
    itl = [g * 1e3 for o in outs for g in o.metrics.itl]
    queue = [o.metrics.time_in_queue * 1e3 for o in outs if o.metrics.time_in_queue is not None]
    st = res.steps
    busy = st[st["num_seqs"] > 0]
    return {**label, "requests": len(outs), "finished": sum(o.finish_reason in ("length", "stop") for o in outs),
            "ttft_ms_p50": _pct(ttft, 50), "ttft_ms_p95": _pct(ttft, 95),
            "short_ttft_ms_p95": _pct(short_ttft, 95), "itl_ms_p95": _pct(itl, 95), "itl_ms_max": max(itl),
            "queue_ms_p50": _pct(queue, 50), "queue_ms_p95": _pct(queue, 95),
            "steps": int(len(busy)), "mean_batch": float(busy["num_seqs"].mean()),
            "tokens_per_s": res.tokens_per_s, "wall_s": res.wall_s,
            "tokens": [list(o.token_ids) for o in outs]}


def trace_run(llm: LLM, cfg: SchedBenchConfig, trace: Trace, static_batch: int | None = None, label=None,
              steps: bool = False, **sched) -> dict:
    """One real-time replay of ``trace`` on a fresh engine (warmed up) with the scheduler options
    ``sched`` (budget ``cfg.token_budget``, 32 sequences unless given): one row of
    :func:`_trace_row`, its ``label`` items first; with ``steps``, also ``steps_frame`` (the
    engine's step records)."""
    sched = {"max_num_seqs": 32, "max_num_batched_tokens": cfg.token_budget, **sched}
    eng = _engine(llm, cfg, **sched)
    eng.generate([trace.requests[0].prompt], SamplingParams(temperature=0.0, max_tokens=2))   # warm-up
    res = replay(eng, trace, static_batch=static_batch)
    row = _trace_row(res, cfg, **(label or {}))
    if steps:
        row["steps_frame"] = res.steps
    return row


def compare_runs(llm: LLM, cfg: SchedBenchConfig, trace: Trace, sides: dict[str, dict], repeats: int = 3,
                 metric: str = "ttft_ms_p95", lower_is_better: bool = True, progress=None):
    """Replay ``trace`` under each of two configurations (``sides``: name -> :func:`trace_run`
    keyword arguments) ``repeats`` times, interleaved, and compare ``metric`` (a row column) with
    :func:`workbench.measure.compare.compare`.  ``Comparison.results[name]`` holds every row,
    with its ``steps_frame``.  ``progress`` (a :class:`workbench.lab.progress.Progress` of
    ``2 * repeats`` replays, or None): told "<side>, run r/R" as each replay starts, and each end."""
    from workbench.measure.compare import compare

    done = {name: 0 for name in sides}

    def run(name, kw):
        done[name] += 1
        if progress is not None:
            progress.start(f"{name}, run {done[name]}/{repeats}")
        row = trace_run(llm, cfg, trace, steps=True, **kw)
        if progress is not None:
            progress.advance()
        return row

    runs = {name: (lambda name=name, kw=kw: run(name, kw)) for name, kw in sides.items()}
    return compare(runs, repeats=repeats, key=lambda row: row[metric], metric=metric, lower_is_better=lower_is_better)


def chunked_prefill(llm: LLM, cfg: SchedBenchConfig, trace: Trace | None = None, on_row=None) -> list[dict]:
    """The trace with chunked prefill off, then on; ``on_row(rows)`` after each (the rows so far)."""
    trace = trace or mixed_trace(llm, cfg)
    rows: list[dict] = []
    for c in (False, True):
        rows.append(trace_run(llm, cfg, trace, label={"chunked_prefill": c}, chunked_prefill=c))
        if on_row is not None:
            on_row(rows)
    return rows


def window_sweep(llm: LLM, cfg: SchedBenchConfig, trace: Trace | None = None, on_row=None) -> list[dict]:
    """The trace under each micro-batch window; ``on_row(rows)`` after each (the rows so far)."""
    trace = trace or mixed_trace(llm, cfg)
    rows: list[dict] = []
    for w in cfg.windows_ms:
        rows.append(trace_run(llm, cfg, trace, label={"window_ms": w}, micro_batch_window_s=w / 1e3))
        if on_row is not None:
            on_row(rows)
    return rows


# ---- 4. scheduler overhead --------------------------------------------------------------------
def overhead(llm: LLM, cfg: SchedBenchConfig) -> dict:
    n = cfg.overhead_batch
    prompts = _prompts(llm, n, cfg.prompt_tokens, cfg.seed + 3)
    eng = _engine(llm, cfg, max_num_seqs=n, max_num_batched_tokens=max(n * cfg.prompt_tokens, n))
    params = SamplingParams(temperature=0.0, max_tokens=cfg.overhead_tokens, ignore_eos=True)
    eng.generate(prompts, params)
    st = eng.steps_frame()
    full = st[(st["num_seqs"] == n) & (st["prefill_tokens"] == 0)]
    if full.empty:
        raise ConfigError(f"no decode step ran with {n} sequences; raise overhead_tokens")
    total = full["schedule_s"] + full["model_s"] + full["post_s"]
    return {"batch": n, "steps": int(len(full)), "schedule_us_p50": float(full["schedule_s"].median() * 1e6),
            "post_us_p50": float(full["post_s"].median() * 1e6), "step_ms_p50": float(total.median() * 1e3),
            "schedule_share": float(full["schedule_s"].sum() / total.sum()),
            "post_share": float(full["post_s"].sum() / total.sum())}


def run_sched_bench(model=None, cfg: SchedBenchConfig | None = None, device=None, dtype=None,
                    experiments=("throughput", "chunked", "window", "overhead"), progress: bool = False) -> dict:
    cfg = cfg or SchedBenchConfig()
    unknown = set(experiments) - {"throughput", "chunked", "window", "overhead"}
    if unknown:
        raise ConfigError(f"unknown sched-bench experiment(s) {sorted(unknown)}; "
                          "choose from throughput, chunked, window, overhead")
    from workbench.bench.vs_transformers import device_name

    llm = model if isinstance(model, LLM) else LLM(model, device=device, dtype=dtype)
    import torch

    from workbench.measure.probe import noise_probe

    probe = noise_probe()             # the noise floor of the verdicts

    res: dict = {"config": asdict(cfg), "device": str(llm.model.device), "device_name": device_name(llm.model.device),
                 "dtype": str(llm.model.lm_head.weight.dtype).replace("torch.", ""),
                 "torch": torch.__version__, "threads": torch.get_num_threads(), "noise": probe.as_dict()}
    trace = mixed_trace(llm, cfg) if {"chunked", "window"} & set(experiments) else None
    steps = [e for e in ("throughput", "chunked", "window", "overhead") if e in experiments]
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=len(steps), desc="sched-bench", unit="exp")
    from workbench.measure.gpu_results import save_partial

    def save(**more) -> None:
        """The result so far, for a time cap that stops the run (scripts/device_check.sh)."""
        try:
            save_partial(_finished({**res, **more}))
        except Exception as e:  # noqa: BLE001 - saving what there is must never stop the measuring
            print(f"sched-bench: could not save the partial result: {type(e).__name__}: {e}", file=sys.stderr)

    for e in steps:
        if e == "throughput":
            res["throughput"] = throughput(llm, cfg)
        elif e == "chunked":
            res["chunked"] = chunked_prefill(llm, cfg, trace, on_row=lambda rows: save(chunked=rows))
        elif e == "window":
            res["window"] = window_sweep(llm, cfg, trace, on_row=lambda rows: save(window=rows))
        else:
            res["overhead"] = overhead(llm, cfg)
        save()
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return _finished(res)


def _finished(res: dict) -> dict:
    """``res`` as the benchmark reports it: the trace rows without their tokens, and whether every
    row of a trace experiment gave the same greedy tokens (``<experiment>_identical_tokens``)."""
    out = dict(res)
    for key in ("chunked", "window"):          # same trace, greedy: every configuration must agree
        if key in out:
            toks = [r.get("tokens") for r in out[key]]
            out[key] = [{k: v for k, v in r.items() if k != "tokens"} for r in out[key]]
            out[f"{key}_identical_tokens"] = all(t == toks[0] for t in toks)
    return out


def _f(v, spec=".1f") -> str:
    return "-" if v is None else format(v, spec)


def format_sched_bench(res: dict) -> str:
    lines = [f"sched-bench on {res['device_name']} ({res['device']}, {res['dtype']}, torch {res['torch']}, "
             f"{res['threads']} threads)"]
    if "throughput" in res:
        t = res["throughput"]
        lines += ["", f"throughput: {t['streams']} greedy streams, batch_invariant={t['batch_invariant']}",
                  f"  sequential {t['sequential_tokens_per_s']:.1f} tok/s | concurrent "
                  f"{t['concurrent_tokens_per_s']:.1f} tok/s | speed-up {t['speedup']:.2f}x ({t['verdict']}) | "
                  f"identical tokens: {t['identical_tokens']}"]
    c = res["config"]
    for key, label in (("chunked", "chunked_prefill"), ("window", "window_ms")):
        if key not in res:
            continue
        title = "chunked prefill" if key == "chunked" else "micro-batch window"
        lines += ["", f"{title}: Poisson {c['rate']}/s, {c['trace_requests']} requests (every "
                      f"{c['long_every']}th {c['long_prompt_tokens']} tokens), budget {c['token_budget']} tokens/step",
                  f"  {label:>15} {'TTFT p50':>9} {'TTFT p95':>9} {'short p95':>9} {'ITL p95':>8} {'ITL max':>8} "
                  f"{'queue p95':>9} {'batch':>6} {'steps':>6} {'tok/s':>7}"]
        for r in res[key]:
            lines.append(f"  {str(r[label]):>15} {_f(r['ttft_ms_p50']):>9} {_f(r['ttft_ms_p95']):>9} "
                         f"{_f(r['short_ttft_ms_p95']):>9} {_f(r['itl_ms_p95']):>8} {_f(r['itl_ms_max']):>8} "
                         f"{_f(r['queue_ms_p95']):>9} {r['mean_batch']:>6.2f} {r['steps']:>6} "
                         f"{r['tokens_per_s']:>7.1f}")
        lines.append(f"  identical greedy tokens across rows: {res[f'{key}_identical_tokens']}")
    if "overhead" in res:
        o = res["overhead"]
        lines += ["", f"scheduler overhead at batch {o['batch']} ({o['steps']} decode steps): schedule "
                      f"{o['schedule_us_p50']:.0f} us p50 = {100 * o['schedule_share']:.2f}% of the step "
                      f"({o['step_ms_p50']:.2f} ms p50); post-processing {100 * o['post_share']:.2f}%"]
    return "\n".join(lines)


__all__ = ["SchedBenchConfig", "run_sched_bench", "format_sched_bench", "mixed_trace", "throughput",
           "chunked_prefill", "window_sweep", "overhead", "trace_run", "compare_runs"]
