"""``workbench quantize``: quantize a model and write a compressed-tensors ``pack-quantized``
checkpoint in the format vLLM and transformers load (transformers checked by the tests, vLLM not run here) and
``workbench generate|serve --model DIR`` runs
(:func:`workbench.quant.export.quantize_checkpoint`)."""

from __future__ import annotations

import json


def _size(n: float) -> str:
    from workbench.cli.tiers import _size as size

    return size(n)


def format_written(res: dict) -> str:
    b = res["bytes"]
    lines = [f"wrote {res['folder']}: compressed-tensors pack-quantized, recipe {res['recipe']} (from {res['source']})"]
    for g, v in res["groups"].items():
        gran = f"g{v['group_size']}" if v["strategy"] == "group" else v["strategy"]
        names = sorted({n.split(".")[-1] for n in v["layers"]})
        lines.append(f"  {g}: w{v['num_bits']}a{v['act_bits'] or 16} {gran} {'sym' if v['symmetric'] else 'asym'} - "
                     f"{len(v['layers'])} layers ({', '.join(names)})")
    lines.append(f"  kept dense: {', '.join(res['dense'])}, plus the embedding and the norms ({res['dtype']})")
    ratio = b["quantized_linears"] / b["linears_as_dense"] if b["linears_as_dense"] else float("nan")
    lines.append(f"  quantized linear weights {_size(b['quantized_linears'])} vs {_size(b['linears_as_dense'])} dense "
                 f"{res['dtype']} ({ratio:.3f}x); model.safetensors {_size(b['file'])}")
    lines += [f"  note: {n}" for n in res.get("notes", [])]
    cal = res.get("calibration")
    if cal:
        src = cal.get("dataset") or cal.get("source")
        lines.append(f"  calibrated on {cal.get('windows')} windows of {cal.get('context')} tokens from {src}")
    return "\n".join(lines)


def cmd_quantize(args) -> int:
    from workbench.errors import ConfigError
    from workbench.quant.export import quantize_checkpoint
    from workbench.quant.recipe import QuantRecipe

    if args.recipe is not None:
        if args.scheme is not None or args.method is not None:
            raise ConfigError("--recipe FILE replaces --scheme / --method: give one or the other")
        recipe = args.recipe
    else:
        if args.scheme is None:
            raise ConfigError("give --scheme (e.g. w4a16:g128) or --recipe FILE")
        recipe = QuantRecipe.parse(args.scheme)
        if args.method is not None:
            if ":" + recipe.method in args.scheme.lower() and recipe.method != args.method:
                raise ConfigError(f"--scheme {args.scheme} names method {recipe.method!r} and --method says "
                                  f"{args.method!r}: give it once")
            recipe = QuantRecipe.parse(f"{args.scheme}:method={args.method}")
    if args.max_windows is not None and args.max_windows < 1:
        raise ConfigError(f"--max-windows must be >= 1, got {args.max_windows}")
    res = quantize_checkpoint(args.model, recipe, args.out, dataset=args.dataset, text_field=args.text_field,
                              max_windows=args.max_windows, device=args.device, dtype=args.dtype,
                              check_finite=args.check_finite)
    print(json.dumps(res, indent=2, default=str) if args.json else format_written(res))
    return 0


def add_quantize_parser(sub) -> None:
    q = sub.add_parser("quantize", help="quantize a model and write a compressed-tensors (pack-quantized) checkpoint "
                                        "(the format vLLM / transformers load; generate --model DIR runs it)")
    q.add_argument("model", help="Hugging Face–format folder, 'bundled', or preset:<name> (random weights)")
    q.add_argument("--scheme", default=None,
                   help="w8a16 | w4a16 | w4a8 | w8a8 with options joined by ':' (gN, pc, pt, asym, fallback=..., "
                        "smooth[=A]), e.g. w4a16:g128")
    q.add_argument("--method", default=None, choices=("rtn", "awq", "gptq"),
                   help="how weights are rounded (default rtn)")
    q.add_argument("--recipe", default=None, help="a recipe file (workbench calibrate-quant writes them) instead of "
                                                  "--scheme / --method; calibrates on the text it names")
    q.add_argument("--dataset", default=None, help="JSONL text file to calibrate AWQ / GPTQ / SmoothQuant on "
                                                   "(default: the recipe file's text, else the bundled held-out "
                                                   "calibration half)")
    q.add_argument("--text-field", default="text", help="field of each JSONL row holding the text")
    q.add_argument("--max-windows", type=int, default=8, help="calibration windows of min(512, context) tokens")
    q.add_argument("--out", required=True, help="folder to write (config.json, model.safetensors, tokenizer, "
                                                "workbench_recipe.json)")
    q.add_argument("--device", default=None, help="where to quantize: cpu, cuda ... (default: cuda if available)")
    q.add_argument("--dtype", default=None, help="dtype of the dense tensors written: float32, bfloat16, float16 "
                                                 "(default: the source checkpoint's)")
    q.add_argument("--no-check-finite", dest="check_finite", action="store_false",
                   help="load source weights that hold NaN / Inf")
    q.add_argument("--json", action="store_true", help="print what was written as JSON")
    q.set_defaults(func=cmd_quantize)
