"""Weight-streaming experiments (``workbench prefetch-bench``): decoder layers in a slow tier,
fetched ``d`` layers ahead while earlier layers compute, through the batched engine.

* :func:`block_size_experiment` - each link's GB/s and latency per block size (the ceiling);
* :func:`pick_config` - a (model, workload) whose per-layer copy / compute ratio is in [0.5, 2]
  (copy: the d = 0 run's copy events; compute: timed layer hooks of the all-resident run);
* :func:`streaming_experiment` - all-resident, d = 0 (synchronous), d = 1, 2, 3, interleaved:
  tokens/s, hit rate, stall, efficiency, GB/s vs the ceiling, resident bytes, greedy tokens,
  and the **hidden share** (below);
* :func:`resident_fraction_sweep` - tokens/s against the layers kept resident;
* :func:`engine_options_check` - greedy tokens with streaming on the eager, fused, compiled engine;
* :func:`prefetch_bench` - all of it, plus a verdict on the source articles' claims.

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

Timing: the slow tier is written and the first ``d + 1`` fetches are complete before the clock
starts (install is not part of a run); every configuration runs the same prompts; configurations
are interleaved round by round (the order reversed every other round); one warm-up round is
discarded.  ``threads=1`` by default: on 2 cores the copy lane's worker needs the other core.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from workbench.engine.core import LLMEngine
from workbench.engine.sampling import SamplingParams
from workbench.errors import ConfigError, WorkbenchError
from workbench.measure.compare import compare_samples
from workbench.prefetch.link import DEFAULT_SIZES, ceiling, measure_link
from workbench.prefetch.weights import WeightStreamConfig, stream_weights
from workbench.sched.config import SchedulerConfig
from workbench.transforms.backends import apply_backends

CLAIM_HIT_RATE = 0.89                 # "prefetch hit rate >= 89 %"
CLAIM_LINK_USE = (0.61, 0.93)         # "link bandwidth use 61 % -> 93 %"
TARGET_HIDDEN = 0.8                   # the criterion
FUSED = {"rmsnorm": "compile", "rope": "compile", "swiglu": "compile"}   # the fused option that runs on a CPU


@dataclass
class Workload:
    """``prompts`` requests of ``prompt_tokens`` seeded random token ids, ``max_tokens`` greedy
    tokens each (EOS ignored), all submitted at once (batch = prompts)."""
    prompts: int = 1
    prompt_tokens: int = 16
    max_tokens: int = 16
    seed: int = 0

    def describe(self) -> str:
        return f"{self.prompts} x ({self.prompt_tokens} prompt + {self.max_tokens} new)"


def make_engine(model=None, dtype=None, workload: Workload | None = None, threads=1, device=None, **kw) -> LLMEngine:
    """A batched engine sized for ``workload``: its whole prefill fits one step."""
    w = workload or Workload()
    sched = kw.pop("scheduler", None) or SchedulerConfig(max_num_seqs=max(1, w.prompts),
                                                        max_num_batched_tokens=max(512, w.prompts * w.prompt_tokens))
    return LLMEngine(model, device=device, dtype=dtype, threads=threads, scheduler=sched, **kw)


def _prompts(engine: LLMEngine, w: Workload) -> list[list[int]]:
    g = torch.Generator().manual_seed(w.seed)
    vocab = engine.model.config.vocab_size
    return torch.randint(1, vocab, (w.prompts, w.prompt_tokens), generator=g).tolist()


class _LayerTimer:
    """Per-execution compute time of every decoder layer (hook to hook), keyed (step, layer);
    CUDA events on a GPU."""

    def __init__(self, model) -> None:
        self.cuda = model.lm_head.weight.device.type == "cuda"
        self.spans, self.step, self._t0 = {}, 0, {}
        self._hooks = [h for i, layer in enumerate(model.model.layers)
                       for h in (layer.register_forward_pre_hook(lambda m, a, i=i: self._pre(i)),
                                 layer.register_forward_hook(lambda m, a, o, i=i: self._post(i)))]

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def _pre(self, i: int) -> None:
        self.step += i == 0
        self._t0[i] = self._mark()

    def _post(self, i: int) -> None:
        self.spans[(self.step, i)] = (self._t0.pop(i), self._mark())

    def seconds(self) -> dict[tuple[int, int], float]:
        for h in self._hooks:
            h.remove()
        if self.cuda:
            torch.cuda.synchronize()
            return {k: a.elapsed_time(b) / 1e3 for k, (a, b) in self.spans.items()}
        return {k: b - a for k, (a, b) in self.spans.items()}


def _run(engine: LLMEngine, w: Workload, distance=None, resident_layers: int = 1, transport: str = "auto",
         ceiling_gbps: float | None = None, timed: bool = False, keep_timeline: bool = False) -> dict:
    """One timed run of ``w``: all-resident (``distance`` None) or streaming at ``distance``."""
    prompts = _prompts(engine, w)
    params = SamplingParams(temperature=0, max_tokens=w.max_tokens, ignore_eos=True)
    streamer = timer = None
    if distance is not None:
        streamer = stream_weights(engine.model, WeightStreamConfig(resident_layers=resident_layers, distance=distance,
                                                                   transport=transport))
        streamer.prefetcher.stats_.ceiling_gbps = ceiling_gbps
        for job in list(streamer.prefetcher.pending.values()):    # the first d + 1 fetches: part of install
            job.done_flag.wait() if job.ready is None else job.ready.synchronize()
    elif timed:
        timer = _LayerTimer(engine.model)
    try:
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
    finally:
        stats = streamer.stats() if streamer is not None else None
        timeline = streamer.prefetcher.timeline() if streamer is not None else None
        if streamer is not None:
            streamer.remove()
        compute = timer.seconds() if timer is not None else None
    bad = [o.error for o in outs if o.error]
    if bad:
        raise WorkbenchError(f"prefetch bench: a request failed: {bad[0]}")
    tokens = [list(o.token_ids) for o in outs]
    out = {"seconds": seconds, "tokens": tokens, "new_tokens": sum(map(len, tokens)), "stats": stats,
           "compute": compute}
    if timeline is not None:
        out["copy_s"] = {}
        for ev in (ev for ev in timeline if ev["lane"] == "copy"):
            out["copy_s"].setdefault(int(ev["label"][1:]), []).append(ev["end"] - ev["start"])
        if keep_timeline:
            out["timeline"] = [ev for ev in timeline if ev["step"] <= 3]
    return out


def _copy_medians(sync_runs: list[dict]) -> dict[int, float]:
    """Each streamed layer's median copy seconds over the synchronous runs' copy events."""
    copy: dict[int, list] = {}
    for x in sync_runs:
        for i, v in x["copy_s"].items():
            copy.setdefault(i, []).extend(v)
    return {i: statistics.median(v) for i, v in copy.items()}


def _ratio(res: dict, sync: dict, streamed: list[int]) -> dict:
    """Per-layer copy (sync run) against compute (all-resident run) over the same executions."""
    copy = _copy_medians([sync])
    execs = [(k, c) for k, c in res["compute"].items() if k[1] in streamed]
    sum_compute = sum(c for _, c in execs)
    sum_copy = sum(copy[k[1]] for k, _ in execs)
    return {"copy_ms": 1e3 * statistics.median(copy.values()),
            "compute_ms_median": 1e3 * statistics.median(c for _, c in execs),
            "compute_ms_mean": 1e3 * sum_compute / len(execs), "executions": len(execs),
            "ratio": sum_copy / sum_compute}


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


def _spread(vals: list[float]) -> dict:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "samples": list(vals)}


def _rounds(engine, w, configs: dict, repeats: int, warmup: bool = True, **kw) -> dict[str, list[dict]]:
    """Run every configuration ``repeats`` times, interleaved (reversed every other round)."""
    names, runs = list(configs), {n: [] for n in configs}
    for r in range(-1 if warmup else 0, repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            res = _run(engine, w, **configs[n], **kw)
            if r >= 0:
                runs[n].append(res)
    return runs


def _row(name: str, runs: list[dict], ref_tokens, ceiling_gbps) -> dict:
    tps = [x["new_tokens"] / x["seconds"] for x in runs]
    row = {"config": name, "tokens_per_s": _spread(tps), "wall_s": _spread([x["seconds"] for x in runs]),
           "tokens_identical": all(x["tokens"] == ref_tokens for x in runs), "runs": len(runs)}
    if runs[0]["stats"] is not None:
        st = [x["stats"] for x in runs]
        med = lambda k: statistics.median(s[k] or 0.0 for s in st)           # noqa: E731
        busy = [s["bytes"] / x["seconds"] / 1e9 / ceiling_gbps if ceiling_gbps else None for s, x in zip(st, runs)]
        row.update({"distance": st[0]["distance"], "prefetch_hit_rate": _spread([s["prefetch_hit_rate"] for s in st]),
                    "stall_s": _spread([s["stall_s"] for s in st]), "copy_s": med("copy_s"),
                    "prefetch_efficiency": _spread([s["prefetch_efficiency"] or 0.0 for s in st]),
                    "achieved_gbps": med("achieved_gbps"), "ceiling_gbps": ceiling_gbps,
                    "link_use": _spread([s["link_use"] or 0.0 for s in st]),
                    "link_busy": _spread(busy) if ceiling_gbps else None, "uses": st[0]["uses"],
                    "demand": st[0]["demand"], "read_mode": st[0].get("read_mode"),
                    **{k: st[0][k] for k in ("resident_bytes", "all_resident_bytes", "slow_tier_bytes",
                                             "resident_layers", "streamed_layers", "buffers")}})
    return row


def streaming_experiment(model=None, resident_layers: int = 1, distances=(0, 1, 2, 3), workload: Workload | None = None,
                         repeats: int = 3, transport: str = "auto", dtype=None, threads=1, device=None,
                         ceiling_gbps: float | None = None, engine: LLMEngine | None = None) -> dict:
    """All-resident, then each distance (0 = synchronous), same workload, interleaved repeats."""
    if 0 not in distances:
        raise ConfigError("streaming_experiment: distances must include 0 (the synchronous baseline)")
    w = workload or Workload()
    eng = engine or make_engine(model, dtype, w, threads, device)
    configs = {"resident": {"timed": True}}
    configs.update({f"d={d}": {"distance": d, "resident_layers": resident_layers, "transport": transport,
                               "ceiling_gbps": ceiling_gbps, "keep_timeline": True} for d in distances})
    runs = _rounds(eng, w, configs, repeats)
    ref = runs["resident"][0]["tokens"]
    rows = [_row(n, runs[n], ref, ceiling_gbps) for n in configs]
    streamed = list(range(resident_layers, len(eng.model.model.layers)))
    copy = _copy_medians(runs["d=0"])
    ideal, lane = [], []
    for x in runs["resident"]:
        execs = [(k, c) for k, c in x["compute"].items() if k[1] in streamed]
        ideal.append(x["seconds"] - sum(c for _, c in execs) + sum(max(copy[k[1]], c) for k, c in execs))
        lane.append(max(x["seconds"], sum(copy[k[1]] for k, _ in execs)))
    t_ideal, t_lane = statistics.median(ideal), statistics.median(lane)
    wall = {n: [x["seconds"] for x in runs[n]] for n in configs}
    best = min((n for n in configs if n not in ("resident", "d=0")), key=lambda n: statistics.median(wall[n]),
               default=None)
    t_sync = statistics.median(wall["d=0"])
    moved = runs["d=0"][0]["stats"]["bytes"]
    out = {"model": model or "bundled", "workload": asdict(w), "resident_layers": resident_layers,
           "layers": len(eng.model.model.layers), "threads": torch.get_num_threads(), "rows": rows,
           "copy_ms_per_layer": 1e3 * statistics.median(copy.values()),
           "t_resident": statistics.median(wall["resident"]),
           "t_sync": t_sync, "t_ideal": t_ideal, "t_ideal_runs": ideal, "t_lane": t_lane, "best": best,
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
                            engine: LLMEngine | None = None, points: int | None = None) -> dict:
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
    runs = _rounds(eng, w, configs, repeats, warmup=False)
    ref = runs[f"resident={L}"][0]["tokens"]
    rows = [{**_row(f"resident={n}", runs[f"resident={n}"], ref, ceiling_gbps), "resident_layers": n,
             "fraction": n / L} for n in counts]
    return {"distance": distance, "layers": L, "workload": asdict(w), "rows": rows}


def block_size_experiment(sizes=DEFAULT_SIZES, total_bytes: int = 64 << 20, repeats: int = 3,
                          transports=("disk", "host"), device=None) -> dict:
    """measure_link per transport: rows (one per link and block size) and each link's ceiling."""
    rows, ceilings = [], {}
    for kind in transports:
        pts = measure_link(kind, sizes=sizes, total_bytes=total_bytes, repeats=repeats, device=device)
        rows += [asdict(p) for p in pts]
        ceilings[kind] = ceiling(pts)
    return {"rows": rows, "ceiling_gbps": ceilings, "total_bytes": total_bytes}


def engine_options_check(model=None, options=("eager", "fused", "compile"), resident_layers: int = 1,
                         distance: int = 2, transport: str = "auto", workload: Workload | None = None,
                         dtype=None, threads=1, device=None) -> list[dict]:
    """Streaming on each engine option - eager (paged KV), fused (per-op ``torch.compile`` of
    rmsnorm, rope and swiglu: the fused option that runs on a CPU; the Triton kernels only run
    under the interpreter here) and compile (contiguous KV, static decode steps through
    ``torch.compile``): greedy tokens against the same engine all-resident, before and after."""
    w = workload or Workload(2, 8, 6)
    rows = []
    for opt in options:
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
    return rows


def _claim(lo: float | None, hi: float | None, target: float) -> str:
    if lo is None or hi is None:
        return "not measured"
    return "holds" if lo >= target else "does not hold" if hi < target else "within noise"


def verdict(exp: dict) -> dict:
    """The articles' claims against what ``exp`` (a streaming_experiment) measured."""
    rows = {r["config"]: r for r in exp["rows"]}
    best, sync = rows.get(exp.get("best")), rows["d=0"]
    out = {}
    if best is not None:
        hr = best["prefetch_hit_rate"]
        out["hit_rate"] = {"claim": f"prefetch hit rate >= {CLAIM_HIT_RATE:.0%}", "measured": hr,
                           "config": best["config"], "verdict": _claim(hr["min"], hr["max"], CLAIM_HIT_RATE),
                           "by_config": {n: r["prefetch_hit_rate"]["median"] for n, r in rows.items()
                                         if r.get("prefetch_hit_rate")}}
        if best.get("link_busy") and sync.get("link_busy"):
            a, b = sync["link_busy"], best["link_busy"]
            cmp = compare_samples(a["samples"], b["samples"], names=("d=0", best["config"]),
                                  metric="link busy share", lower_is_better=False)
            out["link_use"] = {"claim": f"link bandwidth use {CLAIM_LINK_USE[0]:.0%} -> {CLAIM_LINK_USE[1]:.0%}",
                               "measured_sync": a, "measured_best": b, "per_copy_link_use_best": best["link_use"],
                               "bound": exp.get("link_busy_bound"),
                               "comparison": cmp.verdict,
                               "verdict": _claim(b["min"], b["max"], CLAIM_LINK_USE[1]) if cmp.favours(best["config"])
                               else "does not hold" if b["max"] < CLAIM_LINK_USE[1] else "within noise"}
    hs, rng = exp.get("hidden_share"), exp.get("hidden_share_range") or [None, None]
    out["hidden_share"] = {"claim": f"hidden share >= {TARGET_HIDDEN:.0%} (the issue's criterion)", "measured": hs,
                           "range": rng, "verdict": _claim(rng[0], rng[1], TARGET_HIDDEN)}
    out["tokens_identical"] = all(r["tokens_identical"] for r in exp["rows"])
    if "sync_vs_best" in exp:
        out["speed"] = exp["sync_vs_best"]["verdict"]
    return out


# the link's block sizes: smoke (and the device check) / full
LINK_SIZES = {"smoke": (8 << 10, 64 << 10, 512 << 10, 4 << 20), "full": DEFAULT_SIZES}
LINK_SIZES_CUDA = (64 << 10, 512 << 10, 4 << 20, 32 << 20, 128 << 20)   # up to a Llama-3.2-1B layer (~120 MB)


def _slow_kind(dev: torch.device, transport: str) -> str:
    return transport if transport != "auto" else "cuda" if dev.type == "cuda" else "disk"


def link_step(device=None, smoke: bool = True, transport: str = "auto", progress=None) -> dict:
    """The link alone (the device check's ``prefetch_link`` step, before the weight-streaming
    runs): GB/s and latency per block size of the slow tier (pinned host -> HBM on CUDA, the disk
    file on a CPU) and of the host copy; the ceiling the streaming rows divide by."""
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kind = _slow_kind(dev, transport)
    sizes = LINK_SIZES_CUDA if kind == "cuda" else LINK_SIZES["smoke" if smoke else "full"]
    total = max((64 if smoke else 128) << 20, 2 * max(sizes))
    say(f"link: {kind} and host, blocks {', '.join(f'{b >> 10} KiB' for b in sizes)}")
    link = block_size_experiment(sizes, total, 3 if smoke else 5, tuple(dict.fromkeys((kind, "host"))), str(dev))
    return {"mode": "smoke" if smoke else "full", "device": str(dev), "link": link,
            "ceiling_gbps": link["ceiling_gbps"][kind], "seconds": time.perf_counter() - t0}


def prefetch_bench(smoke: bool = True, device=None, threads=1, transport: str = "auto", candidates=None,
                   options=("eager", "fused", "compile"), repeats: int | None = None, link_bytes: int | None = None,
                   progress=None, link: dict | None = None, deadline: float | None = None, on_section=None) -> dict:
    """Everything, sized for < 60 s (smoke) or < 10 min (full) on 2 CPU cores.  ``candidates``
    (for :func:`pick_config`), ``options``, ``repeats`` (streaming runs per configuration) and
    ``link_bytes`` (per block size) override the mode's defaults.

    Sections in order of value, each added to the result as it is done: the link (the ceiling
    every fraction divides by; ``link``: a :func:`link_step` result to reuse instead of measuring
    again), the configuration pick, the streaming runs and the verdict, the resident-fraction
    sweep, the engine options.  ``on_section(result so far)`` is called after each (the device
    check saves it, so a run stopped by its time cap keeps what it measured); past ``deadline``
    (``time.time()``) the sweep and the options are not started."""
    say = progress or (lambda msg: None)
    t0 = time.perf_counter()
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    device = str(dev)
    kind = _slow_kind(dev, transport)
    res: dict = {"mode": "smoke" if smoke else "full", "device": device, "threads": torch.get_num_threads()}

    def section(name, value):
        res[name] = value
        res["seconds"] = time.perf_counter() - t0
        if on_section is not None:
            on_section(res)

    def late() -> bool:
        return deadline is not None and time.time() > deadline

    if link is not None and kind in (link.get("link") or {}).get("ceiling_gbps", {}):
        say("link: measured by the link step")
        link = link["link"]
    else:
        say("link: block sizes")
        sizes = LINK_SIZES_CUDA if kind == "cuda" else LINK_SIZES["smoke" if smoke else "full"]
        total = max(link_bytes or (64 if smoke else 128) << 20, max(sizes))
        link = block_size_experiment(sizes, total, 3 if smoke else 5, tuple(dict.fromkeys((kind, "host"))), device)
    ceil = link["ceiling_gbps"][kind]
    section("link", link)
    section("ceiling_gbps", ceil)
    say("pick a configuration (copy / compute ratio)")
    engines: dict = {}
    pick = pick_config(candidates, transport=transport, threads=threads, device=device, smoke=smoke, engines=engines)
    section("pick", pick)
    ch = pick["chosen"]
    lb = ch["layer_bytes"]
    if lb not in {r["block_bytes"] for r in link["rows"] if r["transport"] == kind}:
        say(f"link: the chosen layer's block size ({lb >> 10} KiB)")       # the size the runs move
        pts = measure_link(kind, sizes=(lb,), total_bytes=max(link.get("total_bytes") or 0, lb),
                           repeats=3 if smoke else 5, device=device)
        link["rows"] += [asdict(p) for p in pts]
        ceil = link["ceiling_gbps"][kind] = max(ceil or 0.0, ceiling(pts) or 0.0) or None
        section("link", link)
        section("ceiling_gbps", ceil)
    w = Workload(ch["prompts"], ch["prompt_tokens"], ch["max_tokens"], ch["seed"])
    model = None if ch["model"] == "bundled" else ch["model"]
    eng = engines[model]
    say(f"streaming: {ch['model']} {w.describe()}")
    exp = streaming_experiment(model, 1, (0, 1, 2, 3), w, repeats or (3 if smoke else 9), transport,
                               ceiling_gbps=ceil, engine=eng)
    section("streaming", exp)
    section("verdict", verdict(exp))
    if late():
        say("past the deadline: no resident-fraction sweep, no engine options")
    else:
        say("resident-fraction sweep")
        sweep = resident_fraction_sweep(model, exp.get("best_distance", 1), w, 1 if smoke else 5, transport,
                                        ceiling_gbps=ceil, engine=eng, points=5 if smoke else None)
        section("sweep", sweep)
    if not late():
        say("engine options")
        section("engine_options", engine_options_check(None, options, transport=transport, threads=threads,
                                                       device=device) if options else [])
    res["seconds"] = time.perf_counter() - t0
    return res


__all__ = ["Workload", "make_engine", "pick_config", "default_candidates", "streaming_experiment",
           "resident_fraction_sweep", "block_size_experiment", "engine_options_check", "verdict", "link_step",
           "prefetch_bench"]
