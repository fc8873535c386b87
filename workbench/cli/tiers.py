"""``workbench tier-bench``: the physical hot / warm / cold KV cache on real decode steps -
quality, measured resident bytes against the formula, routing traffic per predictor, and a
long-context projection to real model shapes (:mod:`workbench.bench.tier_physical`)."""

from __future__ import annotations

import json
import os
import sys

from workbench.cli.prefetch import _table


def _f(v, fmt: str = "{:.3g}", scale: float = 1.0) -> str:
    return "-" if v is None else fmt.format(scale * v)


def _kb(v) -> str:
    return _f(v, "{:.1f}", 1 / 1024)


def _size(n: float) -> str:
    for unit, d in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= d:
            return f"{n / d:.2f} {unit}"
    return f"{n:.0f} B"


def format_tier_bench(res: dict) -> str:
    m = res["model"]
    out = [f"tier-bench: bundled model ({m['layers']} layers, {m['kv_heads']} KV heads, head_dim {m['head_dim']}, "
           f"{m['dtype']} on {m['device']}, {res['threads']} torch thread(s)); {len(res['docs'])} evaluation docs x "
           f"{m['context']} tokens, last {res['eval_tokens']} decoded one token per call and scored; "
           f"{res['store']}; {res['seconds']:.0f} s", "",
           "quality and measured resident memory (bytes at the cache dtype, mean over scored positions; "
           "basis included; MEASURED)"]
    rows = res["rows"]
    out.append(_table(["config", "rel ppl", "KL", "top-1", "measured B/tok", "formula B/tok", "meas/formula",
                       "full B/tok", "reduction", "w/ staging", "max|dlogit| vs accounted", "greedy same"],
                      [[r["config"], f"{100 * r['rel_ppl']:+.2f}% +-{100 * r['rel_ppl_se']:.2f}", f"{r['kl']:.4f}",
                        f"{r['top1']:.3f}", f"{r['measured_bytes_per_token']:.0f}",
                        f"{r['formula_bytes_per_token']:.0f}", f"{r['measured_vs_formula']:.4f}",
                        f"{r['full_bytes_per_token']:.0f}", f"{r['reduction_measured']:.2f}x",
                        f"{r['reduction_with_staging']:.2f}x", _f(r["max_abs_diff_vs_accounted"], "{:.2g}"),
                        "-" if r["greedy_identical"] is None else str(r["greedy_identical"])] for r in rows]))
    out += ["", "routing per decode step (the prefetcher's counters, decode only; KiB and ms per step; "
                "'(all)': the run's total)"]
    out.append(_table(["config", "hit rate", "stall ms", "moved KiB", "routed KiB", "reused (all)", "wasted KiB",
                       "demand (all)", "staging KiB", "offloaded", "ms/step"],
                      [[r["config"], _f(r["prefetch_hit_rate"], "{:.0%}"), f"{r['stall_ms_per_step']:.2f}",
                        _kb(r["bytes_moved_per_step"]), _kb(r["routed_bytes_per_step"]), r["reused"],
                        _kb(r["wasted_bytes_per_step"]), r["demand"], _kb(r["staging_bytes_mean"]),
                        _size(r["offloaded_bytes"]), f"{r['decode_ms_per_step']:.1f}"] for r in rows]))
    pc = res.get("predictors")
    if pc:
        out += ["", f"predictors on {pc['config']} (same docs; quality identical across rows: {pc['same_quality']})"]
        out.append(_table(["offload", "predict", "hit rate", "stall ms/step", "moved KiB/step", "wasted (all)",
                           "wasted KiB/step", "demand (all)", "staging KiB", "ms/step", "error"],
                          [[p["offload"], p["predict"]] + (["-"] * 8 + [p["error"]] if p["error"] else
                           [_f(p["prefetch_hit_rate"], "{:.0%}"), f"{p['stall_ms_per_step']:.2f}",
                            _kb(p["bytes_moved_per_step"]), p["wasted"], _kb(p["wasted_bytes_per_step"]),
                            p["demand"], _kb(p["staging_bytes_mean"]), f"{p['decode_ms_per_step']:.1f}", ""])
                           for p in pc["rows"]]))
    pr = res.get("projection")
    if pr and pr.get("error"):
        out += ["", f"projection: not made ({pr['error']})"]
    elif pr:
        co = pr["coefficients"]
        desc = ", ".join(f"{k} {v['coefficient']:g} x {v['scales_with']} per {v['per']}" for k, v in co.items())
        out += ["", pr["caption"], f"measured coefficients: {desc}"]
        out.append(_table(["kind", "preset", "length", "hot", "warm", "cold", "basis", "tiered", "full", "reduction",
                           "= formula"],
                          [[r["kind"], r["preset"], r["length"], _size(r["hot_bytes"]), _size(r["warm_bytes"]),
                            _size(r["cold_bytes"]), _size(r["basis_bytes"]), _size(r["tiered_bytes"]),
                            _size(r["full_bytes"]), f"{r['reduction']:.1f}x", r["matches_formula"]]
                           for r in pr["rows"]]))
        if pr["basis"]:
            out.append("basis per preset (projection): " + "; ".join(
                f"{b['preset']} {b['layers']}x{b['kv_heads']} x (mean {b['mean_elements']:g} + rank {b['rank']} "
                f"components {b['component_elements']:g}) = {_size(b['bytes'])}" for b in pr["basis"]))
    cl = res.get("claim")
    if cl:
        out += ["", f"claim: {cl['claim']}", f"verdict: {cl['verdict']} (memory: literal reading "
                f"{cl['memory_literal']}, 64K reading {cl['memory_64k']}; accuracy: {cl['accuracy']['verdict']})"]
        out += [f"  - {r}" for r in cl["reasons"]]
        out += [f"  measured: {cl['measured']}", f"  projected: {cl['projected']}"]
    return "\n".join(out)


def cmd_tier_bench(args) -> int:
    import workbench
    from workbench.bench.tier_physical import named_config, tier_bench
    from workbench.errors import ConfigError

    configs = [named_config(c) for c in args.config] if args.config else None
    docs = args.docs if args.docs is not None else (8 if args.full else 2)
    eval_tokens = args.eval_tokens if args.eval_tokens is not None else (256 if args.full else 64)
    for flag, value in (("--docs", docs), ("--eval-tokens", eval_tokens),
                        ("--calibration-docs", args.calibration_docs)):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if args.device and not str(args.device).startswith(("cpu", "cuda")):
        raise ConfigError(f"--device must be cpu or cuda[:N], got {args.device!r}")
    threads = args.threads if args.threads is not None else min(2, os.cpu_count() or 1)
    progress = None if args.json or args.quiet else (lambda msg: print(f"... {msg}", file=sys.stderr))
    llm = workbench.LLM(device=args.device or "cpu", threads=threads)
    res = tier_bench(llm.model.eval(), llm.tokenizer, docs=docs, eval_tokens=eval_tokens, configs=configs,
                     offload=args.offload, predict=args.predict, calibration_docs=args.calibration_docs,
                     context=args.context, compare=not args.no_compare, check_accounted=not args.no_check,
                     progress=progress)
    if args.serve:
        from workbench.bench.tier_serve import SERVE_FIELDS, served_tier_run

        cfg = (configs or [named_config("default")])[0]
        if progress:
            progress(f"served run: workbench serve --tiers ({cfg.name}) per store, {args.serve_requests} requests")
        res["served"] = served_tier_run(stores=("accounted", args.offload),
                                        tier={k: getattr(cfg, k) for k in SERVE_FIELDS},
                                        requests=args.serve_requests, concurrency=args.serve_concurrency,
                                        device=args.device)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2, default=str)
    if args.json:
        print(json.dumps(res, indent=2, default=str))
    else:
        print(format_tier_bench(res))
        if "served" in res:
            from workbench.bench.tier_serve import format_served_run

            print("\n" + format_served_run(res["served"]))
    return 0


OFFLOADS = ("host", "disk")                     # workbench.kv.tier_store (not imported: no torch for --help)
PREDICTORS = ("none", "step", "layer", "both")


def add_tier_bench_parser(sub) -> None:
    p = sub.add_parser("tier-bench", help="the physical hot/warm/cold KV cache on real decode steps: quality, "
                                          "measured bytes vs formula, routing per predictor, long-context projection")
    p.add_argument("--docs", type=int, default=None, help="evaluation documents (default 2; --full: 8)")
    p.add_argument("--eval-tokens", type=int, default=None,
                   help="decode steps scored per document (default 64; --full: 256)")
    p.add_argument("--full", action="store_true", help="8 docs x 256 decoded tokens (several minutes on a CPU)")
    p.add_argument("--context", type=int, default=None, help="tokens per evaluation window (default: the model's)")
    p.add_argument("--calibration-docs", type=int, default=2, help="held-out documents the PCA basis is fitted on")
    p.add_argument("--offload", default="host", choices=list(OFFLOADS), help="the offload tier of the main rows")
    p.add_argument("--predict", default="step", choices=list(PREDICTORS),
                   help="the prefetch predictor of the main rows")
    p.add_argument("--config", nargs="+", default=None, metavar="NAME",
                   help="default, no-routing, int8, or field=value,... over default (e.g. window=64,budget=None); "
                        "default: all three")
    p.add_argument("--device", default=None, help="cpu (default) or cuda")
    p.add_argument("--threads", default=None, help="torch intra-op threads: N or auto (default: at most 2)")
    p.add_argument("--no-compare", action="store_true", help="skip the predictor comparison")
    p.add_argument("--no-check", action="store_true", help="skip the accounted cache's bit-for-bit check")
    p.add_argument("--serve", action="store_true",
                   help="also a served run: `workbench serve --tiers` with the first config, accounted and physical "
                        "(--offload), streamed HTTP requests: tokens/s, TTFT p95, the server's measured KV bytes")
    p.add_argument("--serve-requests", type=int, default=8, help="requests of the served run")
    p.add_argument("--serve-concurrency", type=int, default=4, help="requests in flight in the served run")
    p.add_argument("--out", default=None, help="also write the JSON document to this file")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=cmd_tier_bench)
