"""The weight-streaming experiments of ``workbench prefetch-bench`` (:mod:`workbench.bench.prefetch`):
the configuration pick (copy / compute ratio), all-resident vs d = 0 .. 3 with the hidden share,
the resident-fraction sweep, streaming on each engine option.

**Hidden share** = (t_sync - t_best) / (t_sync - t_ideal): the part of the synchronous run's
extra time that prefetching removed.  t_sync: median wall time at d = 0; t_best: the lowest
median wall time among d >= 1; t_ideal = t_res - sum_e C_e + sum_e max(K_l(e), C_e), where the
sum runs over the streamed-layer executions e of the workload (layer l(e) of one engine step),
t_res and C_e are the wall time and the per-execution compute (hook to hook) of one
all-resident run, and K_l is layer l's median copy time in the d = 0 runs.  That is: every
streamed layer costs the longer of its copy and its compute, nothing else changes.  t_ideal is
computed per all-resident run and its median taken.  A value above 1 is possible and is
reported as measured: the copy lane also runs during what is not a streamed layer (the resident
layers, the head, sampling, scheduling - the next step's first layers are fetched then), which
t_ideal does not credit.  So a second bound is reported next to it: t_lane = max(t_res, sum_e K)
(one copy lane cannot move the bytes faster, the compute cannot beat all-resident), and
``hidden_share_lane`` = (t_sync - t_best) / (t_sync - t_lane).
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict

import torch

from workbench.bench.prefetch_runs import (
    Workload,
    _copy_medians,
    _ratio,
    _rounds,
    _row,
    _run,
    make_engine,
)
from workbench.engine.core import LLMEngine
from workbench.errors import ConfigError, WorkbenchError
from workbench.measure.compare import compare_samples
from workbench.sched.config import SchedulerConfig
from workbench.transforms.backends import apply_backends

FUSED = {"rmsnorm": "compile", "rope": "compile", "swiglu": "compile"}   # the fused option that runs on a CPU


def default_candidates(smoke: bool = True, device=None) -> list[dict]:
    """The configurations :func:`pick_config` tries: the bundled model's decode (its ~3 MB layer
    copies in ~3 ms) at growing batch, then prefill-heavy steps of the ``stream-demo`` preset.
    On CUDA: a Llama-3.2-1B-shaped layer (~120 MB in bf16, ~2.5 ms over PCIe) against prefill
    steps of a few thousand tokens, where its compute takes about as long (smoke: the first
    only -- each candidate costs three runs, each installing ~1.8 GB of streamed layers)."""
    if device is not None and torch.device(device).type == "cuda":
        c = [dict(model="preset:llama-3.2-1b", workload=Workload(4, 512, 2))]
        if not smoke:
            c.append(dict(model="preset:llama-3.2-1b", workload=Workload(8, 1024, 2)))
        return c
    c = [dict(model=None, workload=Workload(1, 16, 16)), dict(model=None, workload=Workload(4, 128, 4))]
    if not smoke:
        c += [dict(model=None, workload=Workload(4, 64, 8)),
              dict(model="preset:stream-demo", workload=Workload(4, 256, 2))]
    return c


def pick_config(candidates: list[dict] | None = None, resident_layers: int = 1, transport: str = "auto",
                dtype=None, threads=1, device=None, smoke: bool = True, engines: dict | None = None) -> dict:
    """Measure the copy / compute ratio of each candidate (``model``, ``workload``) and pick the
    one in [0.5, 2] nearest 1 (or the nearest overall when none is, ``in_range`` False).
    ``engines``: a dict filled with the engine built per model (for reuse)."""
    rows, cands = [], candidates or default_candidates(smoke, device)
    engines = {} if engines is None else engines
    for cand in cands:
        m, w = cand.get("model"), cand["workload"]
        if m not in engines:     # one engine per model, sized for its largest candidate
            ws = [c["workload"] for c in cands if c.get("model") == m]
            engines[m] = make_engine(m, dtype, None, threads, device, scheduler=SchedulerConfig(
                max_num_seqs=max(x.prompts for x in ws),
                max_num_batched_tokens=max(512, *(x.prompts * x.prompt_tokens for x in ws))))
        eng = engines[m]
        _run(eng, w)                                                                   # warm-up
        res = _run(eng, w, timed=True)
        sync = _run(eng, w, distance=0, resident_layers=resident_layers, transport=transport)
        L = len(eng.model.model.layers)
        r = _ratio(res, sync, list(range(resident_layers, L)))
        rows.append({"model": m or "bundled", "workload": w.describe(), **asdict(w), "layers": L,
                     "dtype": str(eng.model.lm_head.weight.dtype).removeprefix("torch."),
                     "layer_bytes": sync["stats"]["layer_bytes"], **r, "in_range": 0.5 <= r["ratio"] <= 2})
    best = min(rows, key=lambda r: (not r["in_range"], abs(math.log(r["ratio"]))))
    return {"candidates": rows, "chosen": best}



def ideal_times(t_resident: float, compute: dict, copy: dict, streamed: list) -> dict:
    """The bounds of one all-resident run (module doc): ``t_ideal`` = ``t_resident`` with every
    streamed-layer execution costing the longer of its copy and its compute, and ``t_lane`` =
    ``max(t_resident, the copies of every streamed execution)``.  ``compute``: seconds per
    ``(step, layer)`` execution (every layer's, resident ones too); ``copy``: each streamed
    layer's copy seconds; ``streamed``: the streamed layers' indices."""
    execs = [(k, c) for k, c in compute.items() if k[1] in streamed]
    return {"t_ideal": t_resident - sum(c for _, c in execs) + sum(max(copy[k[1]], c) for k, c in execs),
            "t_lane": max(t_resident, sum(copy[k[1]] for k, _ in execs))}


def _checked_ideal(ideal: Callable[..., dict], kw: dict) -> tuple[float, float]:
    """A stand-in's answer (a learner's :func:`ideal_times`, notebook 03) on ``kw``: a dict of two
    finite numbers, neither below the all-resident time; else a WorkbenchError naming the rule."""
    t_resident = kw["t_resident"]
    try:
        got = ideal(**kw)
    except Exception as e:  # noqa: BLE001 - the caller's code: one line, not its traceback
        raise WorkbenchError(f"streaming_experiment: ideal raised {type(e).__name__}: {e}") from None
    if not isinstance(got, dict) or not {"t_ideal", "t_lane"} <= set(got):
        raise WorkbenchError(f"streaming_experiment: ideal returned {type(got).__name__} {got!r:.80}; it must return "
                             "a dict with 't_ideal' and 't_lane' (seconds)")
    out = []
    for key in ("t_ideal", "t_lane"):
        v = got[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise WorkbenchError(f"streaming_experiment: ideal returned {key}={v!r}: a finite number of seconds")
        if v < t_resident * (1 - 1e-9) - 1e-12:
            why = ("each streamed execution costs at least its compute: max(copy, compute)" if key == "t_ideal" else
                   "the compute cannot beat the all-resident run: max(t_resident, sum of the copies)")
            raise WorkbenchError(f"streaming_experiment: ideal returned {key}={v:.6g} s, below the all-resident "
                                 f"time {t_resident:.6g} s: {why}")
        out.append(float(v))
    return out[0], out[1]


def streaming_experiment(model=None, resident_layers: int = 1, distances=(0, 1, 2, 3), workload: Workload | None = None,
                         repeats: int = 3, transport: str = "auto", dtype=None, threads=1, device=None,
                         ceiling_gbps: float | None = None, engine: LLMEngine | None = None, bar=None,
                         ideal: Callable[..., dict] | None = None) -> dict:
    """All-resident, then each distance (0 = synchronous), same workload, interleaved repeats.
    ``bar``: a progress bar (``total``, ``start(name)``, ``advance()``), told of every run.
    ``ideal``: a stand-in for :func:`ideal_times` (same keyword arguments; notebook 03's exercise),
    its answers checked (:func:`_checked_ideal`)."""
    if 0 not in distances:
        raise ConfigError("streaming_experiment: distances must include 0 (the synchronous baseline)")
    w = workload or Workload()
    eng = engine or make_engine(model, dtype, w, threads, device)
    configs = {"resident": {"timed": True}}
    configs.update({f"d={d}": {"distance": d, "resident_layers": resident_layers, "transport": transport,
                               "ceiling_gbps": ceiling_gbps, "keep_timeline": True} for d in distances})
    runs = _rounds(eng, w, configs, repeats, bar=bar)
    ref = runs["resident"][0]["tokens"]
    rows = [_row(n, runs[n], ref, ceiling_gbps) for n in configs]
    streamed = list(range(resident_layers, len(eng.model.model.layers)))
    copy = _copy_medians(runs["d=0"])
    ideals, lane = [], []
    for x in runs["resident"]:
        kw = dict(t_resident=x["seconds"], compute=dict(x["compute"]), copy=dict(copy), streamed=list(streamed))
        if ideal is None:
            r = ideal_times(**kw)
            t_i, t_l = r["t_ideal"], r["t_lane"]
        else:
            t_i, t_l = _checked_ideal(ideal, kw)
        ideals.append(t_i)
        lane.append(t_l)
    t_ideal, t_lane = statistics.median(ideals), statistics.median(lane)
    wall = {n: [x["seconds"] for x in runs[n]] for n in configs}
    best = min((n for n in configs if n not in ("resident", "d=0")), key=lambda n: statistics.median(wall[n]),
               default=None)
    t_sync = statistics.median(wall["d=0"])
    moved = runs["d=0"][0]["stats"]["bytes"]
    out = {"model": model or "bundled", "workload": asdict(w), "resident_layers": resident_layers,
           "layers": len(eng.model.model.layers), "threads": torch.get_num_threads(), "rows": rows,
           "copy_ms_per_layer": 1e3 * statistics.median(copy.values()),
           "t_resident": statistics.median(wall["resident"]),
           "t_sync": t_sync, "t_ideal": t_ideal, "t_ideal_runs": ideals, "t_lane": t_lane, "best": best,
           "link_busy_bound": moved / t_lane / 1e9 / ceiling_gbps if ceiling_gbps else None,
           "hidden_share": None, "hidden_share_range": None, "hidden_share_lane": None}
    if best is not None:
        gap = t_sync - t_ideal
        out["t_best"] = statistics.median(wall[best])
        if gap > 0:
            out["hidden_share"] = (t_sync - out["t_best"]) / gap
            out["hidden_share_range"] = [(t_sync - max(wall[best])) / gap, (t_sync - min(wall[best])) / gap]
        if t_sync > t_lane:
            out["hidden_share_lane"] = (t_sync - out["t_best"]) / (t_sync - t_lane)
        out["sync_vs_best"] = compare_samples(wall["d=0"], wall[best], names=("d=0", best), metric="wall time",
                                              unit="s").as_dict()
        out["timeline"] = runs[best][-1].get("timeline")
        out["best_distance"] = int(best[2:])
    return out


def resident_fraction_sweep(model=None, distance: int = 2, workload: Workload | None = None, repeats: int = 2,
                            transport: str = "auto", dtype=None, threads=1, device=None, ceiling_gbps=None,
                            engine: LLMEngine | None = None, points: int | None = None, bar=None) -> dict:
    """Tokens/s with 0 .. L-1 layers resident (and all resident), at ``distance``; ``points``:
    at most that many resident counts, spread over 0 .. L (None: every one)."""
    w = workload or Workload()
    eng = engine or make_engine(model, dtype, w, threads, device)
    L = len(eng.model.model.layers)
    counts = list(range(L + 1))
    if points is not None and points < len(counts):
        counts = sorted({round(i * L / max(1, points - 1)) for i in range(points)})
    configs = {f"resident={n}": {"distance": distance, "resident_layers": n, "transport": transport,
                                 "ceiling_gbps": ceiling_gbps} for n in counts if n < L}
    configs[f"resident={L}"] = {}
    runs = _rounds(eng, w, configs, repeats, warmup=False, bar=bar)
    ref = runs[f"resident={L}"][0]["tokens"]
    rows = [{**_row(f"resident={n}", runs[f"resident={n}"], ref, ceiling_gbps), "resident_layers": n,
             "fraction": n / L} for n in counts]
    return {"distance": distance, "layers": L, "workload": asdict(w), "rows": rows}


def engine_options_check(model=None, options=("eager", "fused", "compile"), resident_layers: int = 1,
                         distance: int = 2, transport: str = "auto", workload: Workload | None = None,
                         dtype=None, threads=1, device=None, bar=None) -> list[dict]:
    """Streaming on each engine option - eager (paged KV), fused (per-op ``torch.compile`` of
    rmsnorm, rope and swiglu: the fused option that runs on a CPU; the Triton kernels only run
    under the interpreter here) and compile (contiguous KV, static decode steps through
    ``torch.compile``): greedy tokens against the same engine all-resident, before and after.
    ``bar``: a progress bar (``total``, ``start(name)``, ``advance()``), told of every option."""
    w = workload or Workload(2, 8, 6)
    rows = []
    if bar is not None:
        bar.total = len(options)
    for opt in options:
        if bar is not None:
            bar.start(f"{opt}: all-resident, streamed, all-resident again")
        t0 = time.perf_counter()
        row = {"option": opt}
        try:
            if opt == "compile":
                eng = make_engine(model, dtype, w, threads, device, kv="contiguous", compile=True,
                                  scheduler=SchedulerConfig(max_num_seqs=2))
            elif opt in ("eager", "fused"):
                eng = make_engine(model, dtype, w, threads, device)
                if opt == "fused":
                    apply_backends(eng.model, FUSED)
            else:
                raise ConfigError(f"engine_options_check: unknown option {opt!r} (eager, fused, compile)")
            before = _run(eng, w)
            streamed = _run(eng, w, distance=distance, resident_layers=resident_layers, transport=transport)
            after = _run(eng, w)
            row.update({"ok": before["tokens"] == streamed["tokens"] == after["tokens"],
                        "tokens_identical": before["tokens"] == streamed["tokens"],
                        "restored_identical": after["tokens"] == before["tokens"],
                        "prefetch_hit_rate": streamed["stats"]["prefetch_hit_rate"], "engine": eng.describe(),
                        "error": None})
        except (WorkbenchError, RuntimeError) as e:
            row.update({"ok": False, "error": f"{type(e).__name__}: {e}"})
        row["seconds"] = time.perf_counter() - t0
        rows.append(row)
        if bar is not None:
            bar.advance()
    return rows
