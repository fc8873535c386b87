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

Modules: :mod:`~workbench.bench.prefetch_runs` (the workload, one timed run, rounds, rows),
:mod:`~workbench.bench.prefetch_streaming` (the configuration pick, the streaming experiment with
the hidden share, the resident-fraction sweep, the engine options); this one measures the link
(:func:`block_size_experiment`, :func:`link_step`), runs everything (:func:`prefetch_bench`) and
judges the claims (:func:`verdict`), and re-exports the others' public names.
"""

from __future__ import annotations

import time
from dataclasses import asdict

import torch

from workbench.bench.prefetch_runs import Workload, make_engine
from workbench.bench.prefetch_streaming import (
    default_candidates,
    engine_options_check,
    pick_config,
    resident_fraction_sweep,
    streaming_experiment,
)
from workbench.measure.compare import compare_samples
from workbench.prefetch.link import DEFAULT_SIZES, ceiling, measure_link

CLAIM_HIT_RATE = 0.89                 # "prefetch hit rate >= 89 %"
CLAIM_LINK_USE = (0.61, 0.93)         # "link bandwidth use 61 % -> 93 %"
TARGET_HIDDEN = 0.8                   # the criterion


def block_size_experiment(sizes=DEFAULT_SIZES, total_bytes: int = 64 << 20, repeats: int = 3,
                          transports=("disk", "host"), device=None, bar=None) -> dict:
    """measure_link per transport: rows (one per link and block size) and each link's ceiling.
    ``bar``: a progress bar (``total``, ``start(name)``, ``advance()``, e.g.
    :class:`workbench.lab.progress.Progress`); its total is set to the links here."""
    rows, ceilings = [], {}
    if bar is not None:
        bar.total = len(transports)
    for kind in transports:
        if bar is not None:
            bar.start(f"link {kind}: {len(sizes)} block sizes x {repeats} repeats, {total_bytes / 2**20:.0f} MiB each")
        pts = measure_link(kind, sizes=sizes, total_bytes=total_bytes, repeats=repeats, device=device)
        if bar is not None:
            bar.advance()
        rows += [asdict(p) for p in pts]
        ceilings[kind] = ceiling(pts)
    return {"rows": rows, "ceiling_gbps": ceilings, "total_bytes": total_bytes}



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
