"""``workbench calibrate-quant``: the per-layer precision that minimises measured latency or
memory while a quality target holds, on a JSONL text file (:mod:`workbench.quant.calibrate`).

::

    workbench calibrate-quant --dataset data/calibration/prose.jsonl --target-metric ppl \\
        --search-space w8a16,w4a16:g128,w4a8 --objective memory --max-degradation 0.02 --out runs/calib
    workbench calibrate-quant --check runs/calib/recipe.json      # LLM(quant=recipe) against the reported figure

Writes ``recipe.json`` (for ``LLM(quant=...)``, ``--quant`` and ``workbench quantize --recipe``),
``pareto.csv`` / ``pareto.html``, ``sensitivity.csv``, ``layer_costs.csv``, ``report.json`` and
``recommendation.txt`` into ``--out``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from workbench.cli.prefetch import _table

if TYPE_CHECKING:
    from workbench.quant.calibrate_stages import CalibrationResult

DEFAULT_LIMITS = {"ppl": "0.02", "kl": "0.01", "top1": "1.0", "exact_match": "3.0"}


def _dataset(spec: str) -> Path:
    """A path, or the name of a shipped calibration set (``reference``, ``prose``)."""
    p = Path(spec)
    if p.exists() or p.suffix or "/" in spec:
        return p
    from workbench.data import calibration_set

    return calibration_set(spec)


def format_result(res: CalibrationResult) -> str:
    """What a calibrator run found, for the terminal: the data, the most sensitive units, the measured
    mixes and the recommendation with its reasons."""
    from workbench.quant.quality import describe_degradation

    metric, d = res.target_metric, res.diagnostics
    rt = d["row_tokens"]
    out = [f"dataset {res.dataset}: {d['rows']} rows ({d['calibration_rows']} calibration, {d['evaluation_rows']} "
           f"evaluation), {d['tokens']:,} tokens; tokens per row {rt['min']}..{rt['max']} (p10 {rt['p10']}, median "
           f"{rt['median']}, p90 {rt['p90']}); split by {repr(d['group_field']) if d['group_field'] else 'row'}; "
           f"windows of {d['context']} tokens spread over each part: search {d['search_windows']} "
           f"({d['search_scored_tokens']:,} scored tokens from {d['search_rows_used']} of its {d['search_rows']} "
           f"rows), "
           f"confirmation {d['confirmation_windows']} ({d['confirmation_scored_tokens']:,} from "
           f"{d['confirmation_rows_used']} of {d['confirmation_rows']} rows), calibration {d['calibration_windows']}",
           f"overlap (8-token n-grams): calibration part vs evaluation part "
           f"{100 * d['overlap_calibration_vs_evaluation_8gram']:.2f}%, "
           f"with the bundled held-out perplexity split {100 * d['overlap_with_heldout_perplexity_split_8gram']:.2f}%; "
           f"rows found verbatim there: {d['rows_verbatim_in_heldout']}"]
    out += [f"warning: {w}" for w in res.warnings]
    r = res.reference["search"]
    out.append(f"unquantized model on the search text: ppl {r['ppl']:.3f}, top-1 {100 * r['top1']:.1f}%"
               + (f", exact match {100 * r['exact_match']:.1f}% of {r['prompts']} prompts"
                  if r["exact_match"] is not None else "")
               + f"; target: {metric} degradation <= {describe_degradation(metric, res.max_degradation)} "
               f"({res.degradation_units}); objective: {res.objective}; backend {res.backend}, "
               f"{res.threads} thread(s)")
    worst = sorted(res.sensitivity, key=lambda s: -s[metric][0])[:8]
    what = ("one unit per decoder block" if res.unit == "block" else
            "q/k/v and gate/up of a block tied" if res.tie_fused else "every layer on its own")
    out += ["", f"most sensitive units (one unit quantized at a time, {what}; {len(res.sensitivity)} measured in "
                f"{res.seconds['sensitivity']:.0f} s; MEASURED)"]
    out.append(_table(["unit", "option", f"{metric} degradation", "agreement"],
                      [[s["layer"], s["option"], describe_degradation(metric, *s[metric]), f"{s['agreement']:.3f}"]
                       for s in worst]))
    cost_h = f"MiB ({res.memory})" if res.objective == "memory" else "ms/step [min..max]"
    rows = []
    for c in res.candidates:
        cost = (f"{c['cost'] / 2**20:.3f}" if res.objective == "memory"
                else f"{c['ms']:.3f} [{c['ms_min']:.3f}..{c['ms_max']:.3f}]")
        conf = ("-" if "confirmation_degradation" not in c else
                describe_degradation(metric, c["confirmation_degradation"], c["confirmation_degradation_se"])
                + ("" if c["confirmed"] else " (over)"))
        rows.append([c["key"] + (" *" if c["key"] == res.recommendation.key else ""), c["label"][:48],
                     describe_degradation(metric, c["degradation"], c["degradation_se"]),
                     "yes" if c["passes"] else "no", conf, cost, f"{c['cost_vs_unquantized']:.3f}x",
                     "yes" if c["pareto"] else ""])
    out += ["", f"measured mixes ({len(rows)}; * = recommended; degradation +- paired se on the search text; the "
                "pick measured on the confirmation text, and a fallback if it fails there; MEASURED)",
            _table(["mix", "layers", f"{metric} degradation", "within limit", "confirmation", cost_h, "vs unquantized",
                    "pareto"], rows)]
    from workbench.quant.calibrate_report import format_recommendation

    out += ["", format_recommendation(res), f"({res.seconds['total']:.0f} s in all)"]
    return "\n".join(out)


def cmd_calibrate_quant(args) -> int:
    from workbench.errors import ConfigError

    if args.check:
        return _check(args)
    if not args.dataset:
        raise ConfigError("--dataset FILE.jsonl is required (or --check recipe.json)")
    from workbench.data import read_jsonl

    # the file's row and size limits, line by line, before torch loads (a refusal takes a fraction of a
    # second); calibrate() reads it again, as it reads it from a library call
    read_jsonl(_dataset(args.dataset), args.text_field)
    import torch

    from workbench.measure.threads import usable_threads
    from workbench.quant.calibrate import calibrate
    from workbench.quant.calibrate_report import write_outputs

    n = usable_threads(args.threads, where="--threads") if args.threads is not None else min(2, torch.get_num_threads())
    if n is not None:
        torch.set_num_threads(n)
    progress = None if args.json or args.quiet else (lambda msg: print(f"... {msg}", file=sys.stderr))
    limit = args.max_degradation if args.max_degradation is not None else DEFAULT_LIMITS.get(args.target_metric, "0")
    res = calibrate(_dataset(args.dataset), target_metric=args.target_metric, max_degradation=limit,
                    search_space_spec=args.search_space, objective=args.objective, model=args.model,
                    device=args.device or "cpu", dtype=args.dtype, text_field=args.text_field,
                    group_field=None if args.group_field == "none" else args.group_field, memory=args.memory,
                    tie_fused=not args.untie_fused, unit=args.unit, context=args.context,
                    eval_windows=args.eval_windows, calib_windows=args.calib_windows,
                    evaluation_fraction=args.evaluation_fraction, em_prompt=args.em_prompt, em_tokens=args.em_tokens,
                    em_prompts=args.em_prompts, backend=args.backend, max_measured=args.max_measured,
                    decode_steps=args.decode_steps, rounds=args.rounds, progress=progress,
                    on_partial=_save_partial, max_dataset_tokens=args.max_dataset_tokens,
                    memory_budget=args.memory_budget)
    out = Path(args.out or f"runs/calibrate/{time.strftime('%Y%m%d-%H%M%S')}")
    paths = write_outputs(res, out)
    try:
        from workbench.lab.quant_view import calibration_pareto_figure

        calibration_pareto_figure(res).write_html(str(out / "pareto.html"), include_plotlyjs=True)
        paths["plot"] = out / "pareto.html"
    except ImportError:                     # plotly is optional for the core package
        pass
    if args.json:
        print(json.dumps({"result": res.as_dict(), "files": {k: str(v) for k, v in paths.items()}}, indent=2,
                         default=str))
        return 0
    print(format_result(res))
    if "recipe" not in paths:
        print("\nno recipe.json: the recommendation is the unquantized model")
    print("\nwrote " + ", ".join(str(p) for p in paths.values()))
    return 0


def _save_partial(res: CalibrationResult) -> None:
    """The result so far, in the shape ``--json`` prints (without the files, written at the end), for a
    time cap that stops the run (``$WORKBENCH_PARTIAL_OUT``: scripts/device_check.sh's calibrate step)."""
    from workbench.measure.gpu_results import save_partial

    try:
        save_partial({"result": res.as_dict()})
    except Exception as e:  # noqa: BLE001 - saving what there is must never stop the measuring
        print(f"calibrate-quant: could not save the partial result: {type(e).__name__}: {e}", file=sys.stderr)


def _check(args) -> int:
    """``--check recipe.json``: LLM(quant=recipe) measured on the recipe's evaluation windows;
    exit 1 when the figure is not reproduced or no longer within the limit."""
    import workbench
    from workbench.model.loader import load_model
    from workbench.quant.calibrate_report import check_reported
    from workbench.quant.quality import describe_degradation
    from workbench.quant.recipe import load_recipe

    from workbench.errors import ConfigError

    _, doc = load_recipe(args.check)
    rep = doc.get("reported")
    if not isinstance(rep, dict):
        raise ConfigError(f"{args.check}: no 'reported' figure to check (this recipe file was not written by "
                          "calibrate-quant)")
    model = rep.get("model") if args.model is None else args.model
    device = args.device or rep.get("device") or "cpu"
    llm = workbench.LLM(model, device=device, dtype=args.dtype or rep.get("dtype"), quant=args.check,
                        quant_backend=rep.get("backend", "auto"))
    ref = load_model(model, device=device, dtype=args.dtype or rep.get("dtype")).eval()
    r = check_reported(doc, llm.model, ref, llm.tokenizer)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        m = r["metric"]
        print(f"{args.check}: {m} degradation reported {describe_degradation(m, r['reported'], r['reported_se'])}, "
              f"measured now with LLM(quant=recipe) {describe_degradation(m, r['measured'], r['measured_se'])} "
              f"(difference {r['difference']:+.2e}: {'reproduced' if r['reproduced'] else 'NOT reproduced'} within "
              f"{r['tolerance']:g}); limit {describe_degradation(m, r['limit'])}: "
              f"{'holds' if r['passes'] else 'does not hold'}")
    return 0 if r["reproduced"] and r["passes"] else 1


def add_calibrate_parser(sub) -> None:
    from workbench.cli.options import count
    from workbench.data import DATASET_BYTES_LIMIT, DATASET_TOKENS_LIMIT, ROW_BYTES_LIMIT
    from workbench.quant.calibrate_names import DEFAULT_SPACES, METRICS, OBJECTIVES

    p = sub.add_parser("calibrate-quant", help="search per-layer precision against a quality target and measured "
                                               "latency or memory on a JSONL text file; writes a recipe")
    p.add_argument("--dataset", default=None, help="JSONL file, one {\"text\": ...} per line (or a shipped set: "
                                                   "reference, prose)")
    p.add_argument("--text-field", default="text", help="the field holding each row's text")
    p.add_argument("--max-dataset-tokens", type=count, default=DATASET_TOKENS_LIMIT,
                   help="most tokens the dataset's rows may hold (default %(default)s; the file is also limited to "
                        f"{DATASET_BYTES_LIMIT >> 20} MiB and a row to {ROW_BYTES_LIMIT >> 20} MiB): past it, "
                        "refused at its line before the rest is read or tokenized")
    p.add_argument("--memory-budget", default=None, metavar="BYTES",
                   help="most host memory the tokenized dataset may take, e.g. 2G or 512M (default: what the machine "
                        "has available, MemAvailable)")
    p.add_argument("--group-field", default="auto",
                   help="rows with the same value of this field (e.g. the document they come from) stay in one part "
                        "of the split; 'auto': 'source' when every row has it; 'none': split row by row")
    p.add_argument("--target-metric", choices=METRICS, default="ppl")
    p.add_argument("--max-degradation", default=None,
                   help="ppl: relative increase (0.02 or 2%%); kl: nats; top1 / exact_match: points lost "
                        f"(defaults {', '.join(f'{k} {v}' for k, v in DEFAULT_LIMITS.items())})")
    p.add_argument("--search-space", default=None,
                   help="comma-separated schemes (each layer may also stay dense); default: "
                        f"{DEFAULT_SPACES['cpu']} on a CPU (W8A8 runs torch._int_mm there), "
                        f"{DEFAULT_SPACES['cuda']} on a GPU")
    p.add_argument("--objective", choices=OBJECTIVES, default="memory",
                   help="minimise measured resident bytes or measured decode-step latency")
    p.add_argument("--memory", choices=("stored", "resident"), default="stored",
                   help="memory objective: the stored format's bytes (what a GPU's kernels hold), or also what the "
                        "backend keeps beside them (torch's int4 CPU op: its own scales-and-zeros)")
    p.add_argument("--unit", choices=("layer", "block"), default="layer",
                   help="what gets one precision: a layer (q/k/v and gate/up tied), or a whole decoder block "
                        "(7x fewer sensitivity measurements: a first pass on a large model)")
    p.add_argument("--untie-fused", action="store_true",
                   help="choose q/k/v and gate/up separately (engines that fuse them need one setting per group)")
    p.add_argument("--model", default=None, help="model folder (default: the bundled model)")
    p.add_argument("--device", default=None, help="default cpu (--check: the recipe's)")
    p.add_argument("--dtype", default=None)
    p.add_argument("--backend", default="auto", help="quantized layers on: auto, reference, cpu, triton")
    p.add_argument("--context", type=int, default=256, help="tokens per window")
    p.add_argument("--eval-windows", type=int, default=8)
    p.add_argument("--calib-windows", type=int, default=8)
    p.add_argument("--evaluation-fraction", type=float, default=0.5, help="share of rows held out for evaluation")
    p.add_argument("--em-prompt", type=int, default=64, help="exact_match: prompt tokens")
    p.add_argument("--em-tokens", type=int, default=4, help="exact_match: continuation tokens to match")
    p.add_argument("--em-prompts", type=int, default=32, help="exact_match: prompts")
    p.add_argument("--max-measured", type=int, default=10,
                   help="mixes quantized and measured for real (at least the uniform ones: one per scheme)")
    p.add_argument("--decode-steps", type=int, default=16, help="latency: decode steps per round")
    p.add_argument("--rounds", type=int, default=5, help="latency: interleaved rounds per mix")
    p.add_argument("--threads", default=None, help="torch threads: N or auto (default min(2, CPUs))")
    p.add_argument("--out", default=None, help="output folder (default runs/calibrate/<time>)")
    p.add_argument("--check", default=None, metavar="RECIPE", help="measure LLM(quant=RECIPE) against the figure "
                                                                  "the calibrator reported")
    p.add_argument("--json", action="store_true")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_calibrate_quant)
