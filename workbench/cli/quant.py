"""``workbench quant-bench``: every quantization recipe's quality on the bundled model, the
memory and CPU decode speed of the formats at a real model's shape, one layer through torch's
CPU ops, and (with a GPU) the Triton kernels against dense bf16 (:mod:`workbench.bench.quant`)."""

from __future__ import annotations

import json
import os
import sys

from workbench.cli.prefetch import _table
from workbench.cli.tiers import _size


def _pct(r: dict) -> str:
    return f"{100 * r['rel_ppl']:+.2f}% +-{100 * r['rel_ppl_se']:.2f}"


# a kernel's error against the float32 product of the same quantized weight, relative to max |ref|:
# bf16 output rounding is ~4e-3; an indexing or unpacking bug is O(1).  Beyond it the command exits 1.
KERNEL_TOLERANCE = 1e-2


def format_quality(q: dict) -> str:
    out = [f"quality: bundled model, {len(q['docs'])} evaluation docs x {q['context']} tokens ({q['tokens']} scored "
           f"tokens), calibration {q['calibration_docs']} other docs; fp32 perplexity {q['ppl_fp32']:.3f}; "
           f"activations: {q['activations']}; {q['seconds']:.0f} s (MEASURED)"]
    rows = []
    for r in q["rows"]:
        if r.get("error"):
            rows.append([r["recipe"], "-", "-", "-", "-", "-", "-", r["error"][:80]])
            continue
        rows.append([r["recipe"], f"{r['ppl']:.3f}", _pct(r), f"{r['kl']:.4f}", f"{r['top1']:.3f}",
                     _size(r["linear_bytes"]), f"{r['linear_vs_bf16']:.3f}x", f"{r['prepare_s']:.1f}"])
    out.append(_table(["recipe", "ppl", "rel ppl +- se", "KL", "top-1", "linear bytes", "vs bf16", "prepare s"], rows))
    if q.get("comparisons"):
        out += ["", "paired over the same tokens (perplexity of the recipe / of the baseline - 1; a difference "
                    "counts beyond 2 se)"]
        out.append(_table(["recipe", "vs", "ppl ratio - 1 +- se", "beyond 2 se"],
                          [[c["recipe"], c["baseline"], f"{100 * c['rel_ppl']:+.2f}% +-{100 * c['rel_ppl_se']:.2f}",
                            "yes" if abs(c["rel_ppl"]) > 2 * c["rel_ppl_se"] else "no"] for c in q["comparisons"]]))
    return "\n".join(out)


def format_preset(p: dict) -> str:
    out = [f"memory and CPU decode: preset {p['preset']} ({p['note']}), 1 sequence, prompt {p['prompt_len']} tokens, "
           f"{p['decode_steps']} decode steps, median ms [min..max]; quantized layers on backend '{p['backend']}'; "
           f"{p['threads']} torch thread(s) of {p['cpu_count']} CPUs (MEASURED)"]
    rows = []
    for r in p["rows"]:
        if r.get("error"):
            rows.append([r["variant"]] + ["-"] * 7 + [r["error"][:80]])
            continue
        pl = r.get("placement") or {}
        where = ", ".join(f"{k} {v}" for k, v in pl.get("layers", {}).items()) or "dense"
        extra = f" (incl. {_size(pl['extra_bytes'])} op copy)" if pl.get("extra_bytes") else ""
        rows.append([r["variant"], _size(r["linear_bytes"]), f"{r.get('linear_vs_bf16', float('nan')):.3f}x",
                     _size(r["total_bytes"]) + extra, f"{r.get('total_vs_bf16', float('nan')):.3f}x",
                     f"{r['ms_per_token']:.1f} [{r['ms_min']:.1f}..{r['ms_max']:.1f}]", f"{r['tokens_per_s']:.2f}",
                     where, ""])
    out.append(_table(["variant", "linear bytes", "vs bf16", "total bytes", "vs bf16", "ms/token", "tok/s",
                       "layers on", "error"], rows))
    return "\n".join(out)


def format_ops(ops: list[dict]) -> str:
    out = ["one layer through torch's CPU ops (random weights; median ms [min..max] of interleaved rounds; MEASURED)"]
    rows = []
    for o in ops:
        dense = next(r for r in o["rows"] if r["side"] == "dense fp32")["ms_median"]
        for r in o["rows"]:
            rows.append([f"{o['shape'][0]}x{o['shape'][1]}", o["m"], r["side"],
                         f"{r['ms_median']:.3f} [{r['ms_min']:.3f}..{r['ms_max']:.3f}]",
                         f"{dense / r['ms_median']:.2f}x",
                         _size(r["weight_bytes"]), f"{r['rel_error_vs_dense']:.2g}"])
    out.append(_table(["out x in", "m", "side", "ms", "vs dense", "weight bytes", "rel err vs dense"], rows))
    return "\n".join(out)


def cmd_quant_bench(args) -> int:
    import torch

    from workbench.bench.quant import DEFAULT_RECIPES, claim_verdicts, preset_rows, quality_rows
    from workbench.errors import ConfigError
    from workbench.quant.cpu_ops import cpu_op_timing

    progress = None if args.json or args.quiet else (lambda msg: print(f"... {msg}", file=sys.stderr))
    docs = args.docs if args.docs is not None else (8 if args.full else 2)
    if docs < 1:
        raise ConfigError(f"--docs must be >= 1, got {docs}")
    from workbench.measure.threads import usable_threads

    n = usable_threads(args.threads, where="--threads") if args.threads is not None else min(2, os.cpu_count() or 1)
    if n is not None:                   # None: "auto" leaves torch's own choice
        torch.set_num_threads(n)
    res: dict = {}
    recipes = args.recipes.split(",") if args.recipes else list(DEFAULT_RECIPES)
    if not args.skip_quality:
        res["quality"] = quality_rows(recipes, docs=docs, context=args.context, progress=progress)
    if args.preset != "none":
        steps = args.decode_steps if args.decode_steps is not None else (8 if args.full else 4)
        res["preset"] = preset_rows(args.preset, decode_steps=steps, progress=progress)
    if args.ops:
        res["ops"] = [cpu_op_timing(8192, 2048, m=m, repeats=10, rounds=3) for m in (1, 8, 64)]
    if args.kernels:
        from workbench.bench.quant_kernels import format_table, quant_kernel_rows

        ms = tuple(int(m) for m in args.kernel_ms.split(","))
        try:
            shapes = tuple(tuple(int(v) for v in s.lower().split("x")) for s in args.kernel_shapes.split(","))
        except ValueError:
            raise ConfigError(f"--kernel-shapes: expected OUTxIN,... (e.g. 4096x4096), "
                              f"got {args.kernel_shapes!r}") from None
        res["kernels"] = quant_kernel_rows(ms=ms, shapes=shapes)
        res["kernels_table"] = format_table(res["kernels"])
        bad = [f"{r['N']}x{r['K']} m={r['m']} {k}={r[k]:.2g}" for r in res["kernels"] for k in r
               if k.endswith("_max_rel_err") and not k.startswith("dense") and r[k] is not None
               and not r[k] <= KERNEL_TOLERANCE]
        res["kernel_errors_beyond_tolerance"] = bad
    gpu = res.get("kernels")
    if gpu is None:                      # the latest committed GPU table, when one exists
        from workbench.measure.gpu_results import latest

        t = latest("quant_bench")
        gpu = t.frame.to_dict("records") if t is not None else None
    res["claims"] = claim_verdicts(res.get("quality"), res.get("preset"), gpu)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=2, default=str)
    if args.json:
        print(json.dumps(res, indent=2, default=str))
        return 1 if res.get("kernel_errors_beyond_tolerance") else 0
    parts = []
    if "quality" in res:
        parts.append(format_quality(res["quality"]))
    if "preset" in res:
        parts.append(format_preset(res["preset"]))
    if "ops" in res:
        parts.append(format_ops(res["ops"]))
    parts.append("\n".join(["verdicts on the source articles' claims "
                            "(MEASURED in this run; GPU: the latest committed table)"]
                           + [f"- {c['claim']}\n    {c['verdict'].upper()}: {c['measured']}" for c in res["claims"]]))
    if "kernels" in res:
        parts.append(res["kernels_table"])
        if res["kernel_errors_beyond_tolerance"]:
            parts.append(f"kernel errors beyond {KERNEL_TOLERANCE:g} (relative to max |ref|): "
                         + "; ".join(res["kernel_errors_beyond_tolerance"]))
    print("\n\n".join(parts))
    return 1 if res.get("kernel_errors_beyond_tolerance") else 0


def add_quant_bench_parser(sub) -> None:
    p = sub.add_parser("quant-bench", help="quantization: quality of every recipe (fp32, bf16, RTN, AWQ, GPTQ, A8), "
                                           "memory and CPU decode speed at a preset's shape, CPU ops, GPU kernels")
    p.add_argument("--full", action="store_true", help="8 evaluation docs and 8 decode steps (default 2 and 4)")
    p.add_argument("--docs", type=int, default=None, help="evaluation documents")
    p.add_argument("--context", type=int, default=256, help="tokens per evaluation / calibration document")
    p.add_argument("--recipes", default=None, help="comma-separated recipes (default: the whole ladder)")
    p.add_argument("--skip-quality", action="store_true", help="no perplexity table")
    p.add_argument("--preset", default="llama-3.2-1b",
                   help="shape preset for memory and decode speed (random weights), or 'none'")
    p.add_argument("--decode-steps", type=int, default=None)
    p.add_argument("--ops", action="store_true",
                   help="also time one 8192x2048 layer through torch's CPU ops (m=1, 8, 64)")
    p.add_argument("--kernels", action="store_true", help="also time the Triton kernels against dense bf16 (GPU only)")
    p.add_argument("--kernel-ms", default="1,2,4,8,16,32,64", help="rows m of the kernel table")
    p.add_argument("--kernel-shapes", default="4096x4096,11008x4096,4096x11008",
                   help="OUTxIN layer shapes of the kernel table (default: Llama-2-7B's)")
    p.add_argument("--threads", default=None, help="torch threads: N or auto (default min(2, CPUs))")
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", default=None, help="also write the result as JSON")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_quant_bench)
