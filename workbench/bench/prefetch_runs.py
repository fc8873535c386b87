"""One timed run of the weight-streaming bench (:mod:`workbench.bench.prefetch`): the workload,
the engine sized for it, a run all-resident or streaming at distance ``d`` (tokens, prefetch
stats, copy events, per-layer compute), interleaved rounds of configurations and a row of
medians per configuration.

Timing: the slow tier is written and the first ``d + 1`` fetches are complete before the clock
starts (install is not part of a run); every configuration runs the same prompts; configurations
are interleaved round by round (the order reversed every other round); one warm-up round is
discarded.  ``threads=1`` by default: on 2 cores the copy lane's worker needs the other core.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from workbench.engine.core import LLMEngine
from workbench.engine.sampling import SamplingParams
from workbench.errors import WorkbenchError
from workbench.prefetch.weights import WeightStreamConfig, stream_weights
from workbench.sched.config import SchedulerConfig


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



def _spread(vals: list[float]) -> dict:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "samples": list(vals)}


def _rounds(engine, w, configs: dict, repeats: int, warmup: bool = True, bar=None, **kw) -> dict[str, list[dict]]:
    """Run every configuration ``repeats`` times, interleaved (reversed every other round).
    ``bar``: a progress bar (``total``, ``start(name)``, ``advance()``), told of every run."""
    names, runs = list(configs), {n: [] for n in configs}
    if bar is not None:
        bar.total = (repeats + bool(warmup)) * len(names)
    for r in range(-1 if warmup else 0, repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            if bar is not None:
                bar.start(f"{'warm-up round' if r < 0 else f'round {r + 1}/{repeats}'}: {n}")
            res = _run(engine, w, **configs[n], **kw)
            if bar is not None:
                bar.advance()
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
