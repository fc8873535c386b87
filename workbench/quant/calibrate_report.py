"""What the calibrator (:mod:`workbench.quant.calibrate`) found, in words and files, and the
check that a recipe file's figure is reproduced.

::

    write_outputs(res, "runs/calib")      # recipe.json, pareto.csv, sensitivity.csv, layer_costs.csv, report.json, recommendation.txt
    print(format_recommendation(res))
    check_reported(doc, LLM(quant="runs/calib/recipe.json").model, unquantized_model, tokenizer)
"""

from __future__ import annotations

import json
from pathlib import Path

from workbench.errors import ConfigError
from workbench.quant.quality import METRICS, EvalSet, Reference, describe_degradation, measure
from workbench.quant.search import DENSE
from workbench.quant.sensitivity import layer_kind


def reasons(rec: dict, measured: dict, sens: list[dict], metric: str, objective: str, limit: float) -> list[str]:
    """Why the recommendation is what it is, in sentences built from the measurements."""
    out = []
    unit = "bytes" if objective == "memory" else "ms per decode step"
    cost_s = (lambda c: f"{c / 2**20:.2f} MiB") if objective == "memory" else (lambda c: f"{c:.3f} ms")
    lim = describe_degradation(metric, limit)
    out.append(f"least measured {objective} ({unit}) among the measured mixes whose {metric} degradation is within "
               f"{lim} on the search text and on the confirmation text: {rec['label']} at {cost_s(rec['cost'])} "
               f"({rec['cost_vs_unquantized']:.3f}x the unquantized model); degradation "
               f"{describe_degradation(metric, rec['degradation'], rec['degradation_se'])} on the confirmation text "
               f"(search text: {describe_degradation(metric, rec['search_degradation'], rec['search_degradation_se'])})"
               + ("" if rec["passes_beyond_noise"] else " - within 2 standard errors of the limit: another sample of "
                  "text could put it over"))
    if rec.get("not_confirmed"):
        out.append(f"cheaper mixes within the limit on the search text but over it on the confirmation text: "
                   f"{', '.join(rec['not_confirmed'])} (chosen on noise)")
    if rec.get("latency_comparison"):
        out.append(f"decode step vs the unquantized model: {rec['latency_comparison']['verdict']}")
    for key, r in measured.items():
        if r["kind"] == "uniform" and key != rec["key"] and key != "unquantized":
            state = "within the limit" if r["passes"] else "over the limit"
            out.append(f"{key} everywhere: {describe_degradation(metric, r['degradation'], r['degradation_se'])} "
                       f"({state}), {cost_s(r['cost'])}")
    a = rec.get("assignment") or {}
    if a:
        lowest = {}
        for r in sens:
            lowest.setdefault(r["option"], []).append(r)
        by_opt: dict[str, list[str]] = {}
        for l, o in a.items():
            by_opt.setdefault(o, []).append(l)
        cheapest_q = [o for o in by_opt if o != DENSE]
        for o, layers in sorted(by_opt.items(), key=lambda kv: len(kv[1])):
            if len(layers) == len(a):
                continue
            short = ", ".join(_short(l) for l in layers[:6]) + (f" and {len(layers) - 6} more" if len(layers) > 6 else "")
            if o == DENSE:
                out.append(f"left unquantized: {short}" + (" - no option was cheaper there, or their single-layer "
                                                          "degradation was the largest" if cheapest_q else ""))
            else:
                worst = [r for r in sens if r["layer"] in layers and r["option"] != o]
                if worst:
                    w = max(worst, key=lambda r: r[metric][0])
                    out.append(f"{o}: {short} (e.g. {_short(w['layer'])} alone under {w['option']}: "
                               f"{describe_degradation(metric, *w[metric])})")
                else:
                    out.append(f"{o}: {short}")
    return out


def _short(layer: str) -> str:
    block, kind = layer_kind(layer)
    return f"L{block}.{kind}" if block is not None else kind


def write_outputs(res: dict, out_dir) -> dict:
    """``recipe.json`` (the recommendation, unless it is the unquantized model), ``pareto.csv``,
    ``sensitivity.csv``, ``layer_costs.csv``, ``report.json``, ``recommendation.txt``; returns
    their paths."""
    import pandas as pd

    from workbench.quant.recipe import QuantRecipe, save_recipe

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    rec = res["recommendation"]
    if rec["recipe_fields"] is not None:
        reported = {"target_metric": res["target_metric"], "degradation": rec["degradation"],
                    "degradation_se": rec["degradation_se"], "max_degradation": res["max_degradation"],
                    "metrics": rec["metrics"], "objective": res["objective"], "cost": rec["cost"],
                    "cost_vs_unquantized": rec["cost_vs_unquantized"], "backend": res["backend"],
                    "evaluation": res["evaluation"], "model": res["model"]}
        paths["recipe"] = save_recipe(out / "recipe.json", QuantRecipe.from_dict(rec["recipe_fields"]),
                                      calibration=res["calibration"], reported=reported)
    cols = ["key", "kind", "label", "degradation", "degradation_se", "passes", "passes_beyond_noise",
            "confirmation_degradation", "confirmation_degradation_se", "confirmed", "cost", "cost_vs_unquantized",
            "pareto", "predicted_cost", "predicted_degradation", "recipe"]
    pd.DataFrame([{c: r.get(c) for c in cols} | {"recommended": r["key"] == rec["key"]} for r in res["candidates"]]
                 ).to_csv(out / "pareto.csv", index=False)
    paths["pareto"] = out / "pareto.csv"
    sens = pd.DataFrame([{**{k: v for k, v in r.items() if k not in METRICS},
                          **{f"{m}_delta": r[m][0] for m in METRICS if m in r},
                          **{f"{m}_se": r[m][1] for m in METRICS if m in r}} for r in res["sensitivity"]])
    sens.to_csv(out / "sensitivity.csv", index=False)
    paths["sensitivity"] = out / "sensitivity.csv"
    pd.DataFrame(res["layer_costs"]).drop(columns=["samples"], errors="ignore").to_csv(out / "layer_costs.csv", index=False)
    paths["layer_costs"] = out / "layer_costs.csv"
    (out / "report.json").write_text(json.dumps(res, indent=2, default=_json_default) + "\n")
    paths["report"] = out / "report.json"
    (out / "recommendation.txt").write_text(format_recommendation(res) + "\n")
    paths["recommendation"] = out / "recommendation.txt"
    return paths


def _json_default(o):
    return str(o)


def format_recommendation(res: dict) -> str:
    rec = res["recommendation"]
    lines = [f"recommendation ({res['objective']}, {res['target_metric']} within "
             f"{describe_degradation(res['target_metric'], res['max_degradation'])}): {rec['label']}"
             + (f"  [{rec['recipe']}]" if rec["recipe"] else "  [no quantization]")]
    lines += [f"- {r}" for r in rec["reasons"]]
    return "\n".join(lines)


def evaluation_set(doc: dict, tokenizer) -> EvalSet:
    """The evaluation windows a recipe file's ``reported`` figure was measured on, rebuilt from
    the file they came from (checked by SHA-256: :func:`workbench.data.windows_from_spec`)."""
    from workbench.data import windows_from_spec

    ev = (doc.get("reported") or {}).get("evaluation")
    if not ev:
        raise ConfigError("this recipe file has no 'reported.evaluation': it was not written by the calibrator")
    return EvalSet.build(windows_from_spec(ev, tokenizer), em_prompt=ev["em_prompt"], em_tokens=ev["em_tokens"],
                         em_prompts=ev["em_prompts"])


def check_reported(doc: dict, model, reference_model, tokenizer) -> dict:
    """Measure ``model`` (quantized with the recipe of ``doc``, e.g. ``LLM(quant=path).model``)
    on the recipe's evaluation windows against ``reference_model`` (the unquantized one) and
    set the result beside what the calibrator reported."""
    rep = doc["reported"]
    metric = rep["target_metric"]
    ev = evaluation_set(doc, tokenizer)
    q = measure(model, Reference(reference_model, ev, exact_match=metric == "exact_match"))
    d, se = q["degradation"][metric]
    return {"metric": metric, "reported": rep["degradation"], "reported_se": rep["degradation_se"],
            "measured": d, "measured_se": se, "difference": d - rep["degradation"],
            "limit": rep["max_degradation"], "passes": d <= rep["max_degradation"]}
