"""What the calibrator (:mod:`workbench.quant.calibrate`) found, in words and files, and the
check that a recipe file's figure is reproduced.

::

    # writes recipe.json, pareto.csv, sensitivity.csv, layer_costs.csv, report.json, recommendation.txt
    write_outputs(res, "runs/calib")
    print(format_recommendation(res))
    check_reported(doc, LLM(quant="runs/calib/recipe.json").model, unquantized_model, tokenizer)
"""

from __future__ import annotations

import json
import math
from math import comb
from pathlib import Path

from workbench.errors import ConfigError
from workbench.quant.quality import METRICS, EvalSet, Reference, describe_degradation, measure
from workbench.quant.search import DENSE
from workbench.quant.sensitivity import layer_kind
from workbench.data import windows_from_spec
from workbench.model.loader import load_model
from workbench.quant.apply import quantize_model
from workbench.quant.calibrate_stages import result_dict
from workbench.quant.recipe import QuantRecipe, save_recipe


def reasons(rec: dict, measured: dict, sens: list[dict], metric: str, objective: str, limit: float,
            cost: dict | None = None, units: dict | None = None) -> list[str]:
    """Why the recommendation is what it is, in sentences built from the measurements
    (``cost``: the per-unit costs, ``units``: unit -> layers, as the search used them)."""
    out = []
    unit = "bytes" if objective == "memory" else "ms per decode step"
    cost_s = (lambda c: f"{c / 2**20:.2f} MiB") if objective == "memory" else (lambda c: f"{c:.3f} ms")
    lim = describe_degradation(metric, limit)
    tries = rec.get("confirmation_tries") or []
    out.append(f"least measured {objective} ({unit}) among the measured mixes within {lim} on the search text, "
               f"confirmed on the confirmation text: {rec['label']} at {cost_s(rec['cost'])} "
               f"({rec['cost_vs_unquantized']:.3f}x the unquantized model); {metric} degradation "
               f"{describe_degradation(metric, rec['degradation'], rec['degradation_se'])} on the confirmation text "
               f"(search text: {describe_degradation(metric, rec['search_degradation'], rec['search_degradation_se'])})"
               + ("" if rec["passes_beyond_noise"] else " - within 2 standard errors of the limit: another sample of "
                  "text could put it over"))
    if rec.get("not_confirmed"):
        out.append(f"within the limit on the search text but not confirmed on the confirmation text: "
                   f"{', '.join(rec['not_confirmed'])}; the recommendation is "
                   + ("the unquantized model, after every fallback failed" if rec["key"] == "unquantized" else
                      "the first fallback (within the limit beyond 2 standard errors on the search text) that held "
                      f"beyond 2 standard errors on the confirmation text, after {len(tries)} looks at it")
                   + "")
    if rec.get("latency_comparison"):
        out.append(f"decode step vs the unquantized model: {rec['latency_comparison']['verdict']}")
    for key, r in measured.items():
        if r["kind"] == "uniform" and key != rec["key"] and key != "unquantized":
            state = "within the limit" if r["passes"] else "over the limit"
            out.append(f"{key} everywhere: {describe_degradation(metric, r['degradation'], r['degradation_se'])} "
                       f"on the search text ({state}), {cost_s(r['cost'])}")
    a = rec.get("assignment") or {}
    if not a or cost is None or units is None:
        return out
    unit_opt = {u: a[ls[0]] for u, ls in units.items() if ls[0] in a}
    d = {(r["layer"], r["option"]): r[metric] for r in sens}
    by_opt: dict[str, list[str]] = {}
    for u, o in unit_opt.items():
        by_opt.setdefault(o, []).append(u)
    for o, us in sorted(by_opt.items(), key=lambda kv: len(kv[1])):
        if len(us) == len(unit_opt):
            continue
        short = ", ".join(_short(u) for u in us[:6]) + (f" and {len(us) - 6} more" if len(us) > 6 else "")
        # the cheaper options these units did not get, and what the worst of them measured alone
        cheaper = [(u, o2) for u in us for o2 in {k[1] for k in cost if k[0] == u}
                   if cost[(u, o2)] < cost[(u, o)] and (u, o2) in d]
        if cheaper:
            u, o2 = max(cheaper, key=lambda k: d[k][0])
            out.append(f"{'left unquantized' if o == DENSE else o}: {short} - a cheaper option costs quality there: "
                       f"{_short(u)} alone under {o2} measured {describe_degradation(metric, *d[(u, o2)])}")
        elif o == DENSE:
            fastest_q = min((cost[(u, o2)] for u in us for o2 in {k[1] for k in cost if k[0] == u} if o2 != DENSE),
                            default=None)
            out.append(f"left unquantized: {short} - no option is cheaper there"
                       + (f" (dense {cost_s(sum(cost[(u, DENSE)] for u in us) / len(us))} per unit, the cheapest "
                          f"quantized option {cost_s(fastest_q)})" if fastest_q is not None else ""))
        else:
            out.append(f"{o}: {short} - the cheapest option there")
    return out


def _short(layer: str) -> str:
    block, kind = layer_kind(layer)
    return f"L{block}.{kind}" if block is not None else kind


def write_outputs(res, out_dir) -> dict:
    """``recipe.json`` (the recommendation, unless it is the unquantized model), ``pareto.csv``,
    ``sensitivity.csv``, ``layer_costs.csv``, ``report.json``, ``recommendation.txt`` of ``res``
    (a :class:`~workbench.quant.calibrate_stages.CalibrationResult`, or its JSON dict); returns
    their paths."""
    import pandas as pd  # lazy: pandas (~1 s) only to write the tables

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    rec = res["recommendation"]
    if rec["recipe_fields"] is not None:
        reported = {"target_metric": res["target_metric"], "degradation": rec["degradation"],
                    "degradation_se": rec["degradation_se"], "max_degradation": res["max_degradation"],
                    "metrics": rec["metrics"], "objective": res["objective"], "cost": rec["cost"],
                    "cost_vs_unquantized": rec["cost_vs_unquantized"], "backend": res["backend"],
                    "device": res["device"], "dtype": res.get("dtype"), "memory": res.get("memory"),
                    "evaluation": res["evaluation"], "model": res["model"]}
        paths["recipe"] = save_recipe(out / "recipe.json", QuantRecipe.from_dict(rec["recipe_fields"]),
                                      calibration=res["calibration"], reported=reported)
    cols = ["key", "kind", "label", "degradation", "degradation_se", "passes", "passes_beyond_noise",
            "confirmation_degradation", "confirmation_degradation_se", "confirmed", "cost", "cost_vs_unquantized",
            "stored_bytes", "op_copy_bytes", "ms", "ms_min", "ms_max", "pareto", "predicted_cost",
            "predicted_degradation", "recipe"]
    pd.DataFrame([{c: r.get(c) for c in cols} | {"recommended": r["key"] == rec["key"]} for r in res["candidates"]]
                 ).to_csv(out / "pareto.csv", index=False)
    paths["pareto"] = out / "pareto.csv"
    sens = pd.DataFrame([{**{k: v for k, v in r.items() if k not in METRICS},
                          **{f"{m}_delta": r[m][0] for m in METRICS if m in r},
                          **{f"{m}_se": r[m][1] for m in METRICS if m in r}} for r in res["sensitivity"]])
    sens.to_csv(out / "sensitivity.csv", index=False)
    paths["sensitivity"] = out / "sensitivity.csv"
    pd.DataFrame(res["layer_costs"]).drop(columns=["samples"], errors="ignore").to_csv(out / "layer_costs.csv",
                                                                                       index=False)
    paths["layer_costs"] = out / "layer_costs.csv"
    (out / "report.json").write_text(json.dumps(result_dict(res), indent=2, default=_json_default) + "\n")
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
    ev = (doc.get("reported") or {}).get("evaluation")
    if not ev:
        raise ConfigError("this recipe file has no 'reported.evaluation': it was not written by the calibrator")
    return EvalSet.build(windows_from_spec(ev, tokenizer), em_prompt=ev.get("em_prompt", 64),
                         em_tokens=ev.get("em_tokens", 4), em_prompts=ev.get("em_prompts", 32))


def check_reported(doc: dict, model, reference_model, tokenizer) -> dict:
    """Measure ``model`` (quantized with the recipe of ``doc``, e.g. ``LLM(quant=path).model``)
    on the recipe's evaluation windows against ``reference_model`` (the unquantized one) and
    set the result beside what the calibrator reported."""
    rep = doc.get("reported")
    if not isinstance(rep, dict) or any(k not in rep for k in ("target_metric", "degradation", "max_degradation")):
        raise ConfigError("this recipe file has no complete 'reported' figure (target_metric, degradation, "
                          "max_degradation): it was not written by the calibrator")
    metric = rep["target_metric"]
    ev = evaluation_set(doc, tokenizer)
    q = measure(model, Reference(reference_model, ev, exact_match=metric == "exact_match"))
    d, se = q["degradation"][metric]
    diff = d - rep["degradation"]
    return {"metric": metric, "reported": rep["degradation"], "reported_se": rep.get("degradation_se"),
            "measured": d, "measured_se": se, "difference": diff, "tolerance": REPRODUCE_TOLERANCE,
            "reproduced": abs(diff) <= REPRODUCE_TOLERANCE, "limit": rep["max_degradation"],
            "passes": d <= rep["max_degradation"]}


# the same recipe measured again on the same windows differs only by float reductions (thread
# count, op order): ~1e-9 relative here; a different number means different weights or text
REPRODUCE_TOLERANCE = 1e-6


P_BEYOND_2SE = 0.0455          # two-sided normal tail beyond 2 standard errors


def binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return float(sum(comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1)))


def _rank(xs: list[float]) -> list[float]:
    order = sorted(range(len(xs)), key=lambda i: xs[i])
    r = [0.0] * len(xs)
    i = 0
    while i < len(order):                       # average ranks over ties
        j = i
        while j + 1 < len(order) and xs[order[j + 1]] == xs[order[i]]:
            j += 1
        for k in range(i, j + 1):
            r[order[k]] = (i + j) / 2
        i = j + 1
    return r


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation of two equally long lists (nan when either is constant)."""
    ra, rb = _rank(a), _rank(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    va, vb = sum((x - ma) ** 2 for x in ra), sum((y - mb) ** 2 for y in rb)
    return cov / (va * vb) ** 0.5 if va > 0 and vb > 0 else float("nan")


def compare_domains(a: dict, b: dict, names: tuple[str, str] = ("A", "B")) -> dict:
    """Two calibrator results on different text (same model, metric, objective and search space):
    do their recommendations differ, and is what separates them beyond the noise?

    * ``same_recommendation``; ``layers_assigned_differently`` (layer -> (option in A, in B));
    * ``uniform``: each uniform mix's degradation on both texts' search halves (unpaired: the
      texts differ, so the standard errors add in quadrature) and whether the difference is
      beyond 2 of them;
    * ``sensitivity``: per option, the rank correlation of the single-unit degradations and the
      units whose two deltas differ beyond 2 standard errors;
    * ``explanation``: sentences built from the above."""
    if ((a["target_metric"], a["objective"], a["search_space"])
            != (b["target_metric"], b["objective"], b["search_space"])):
        raise ConfigError("compare_domains: the two results need the same target metric, objective and search space")
    metric = a["target_metric"]
    ra, rb = a["recommendation"], b["recommendation"]
    aa, ab = ra.get("assignment") or {}, rb.get("assignment") or {}
    diff = {l: (aa.get(l, DENSE), ab.get(l, DENSE)) for l in sorted(set(aa) | set(ab))
            if aa.get(l, DENSE) != ab.get(l, DENSE)}
    ua = {r["key"]: r for r in a["candidates"] if r["kind"] == "uniform"}
    ub = {r["key"]: r for r in b["candidates"] if r["kind"] == "uniform"}
    uniform = []
    for k in ua:
        if k in ub and k != "unquantized":
            d = ua[k]["degradation"] - ub[k]["degradation"]
            se = math.hypot(ua[k]["degradation_se"], ub[k]["degradation_se"])
            uniform.append({"mix": k, names[0]: ua[k]["degradation"], f"{names[0]}_se": ua[k]["degradation_se"],
                            names[1]: ub[k]["degradation"], f"{names[1]}_se": ub[k]["degradation_se"],
                            "difference": d, "difference_se": se, "beyond_2se": abs(d) > 2 * se,
                            f"{names[0]}_within_limit": ua[k]["passes"], f"{names[1]}_within_limit": ub[k]["passes"]})
    sens = []
    sa = {(r["layer"], r["option"]): r[metric] for r in a["sensitivity"]}
    sb = {(r["layer"], r["option"]): r[metric] for r in b["sensitivity"]}
    for opt in (o for o in a["search_space"] if o != DENSE):
        keys = [k for k in sa if k[1] == opt and k in sb]
        if len(keys) < 3:
            continue
        beyond = [k[0] for k in keys if abs(sa[k][0] - sb[k][0]) > 2 * math.hypot(sa[k][1], sb[k][1])]
        sens.append({"option": opt, "layers": len(keys), "rank_correlation": spearman([sa[k][0] for k in keys],
                                                                                     [sb[k][0] for k in keys]),
                     "layers_beyond_2se": beyond,
                     f"mean_{names[0]}": sum(sa[k][0] for k in keys) / len(keys),
                     f"mean_{names[1]}": sum(sb[k][0] for k in keys) / len(keys)})
    same = ra["label"] == rb["label"] and not diff
    expl = []
    if same:
        expl.append(f"both texts get the same recommendation: {ra['label']}")
    else:
        expl.append(f"the recommendations differ: {names[0]} {ra['label']}; {names[1]} {rb['label']} "
                    f"({len(diff)} of {max(len(aa), len(ab), 1)} layers assigned differently)")
    for u in (uniform if not same else []):          # what may have decided between two different choices
        if u[f"{names[0]}_within_limit"] != u[f"{names[1]}_within_limit"]:
            inside = names[0] if u[f"{names[0]}_within_limit"] else names[1]
            expl.append(f"{u['mix']} everywhere is within the limit on {inside} only: "
                        f"{describe_degradation(metric, u[names[0]], u[f'{names[0]}_se'])} on {names[0]} vs "
                        f"{describe_degradation(metric, u[names[1]], u[f'{names[1]}_se'])} on {names[1]}; "
                        "the difference "
                        + ("is beyond 2 standard errors" if u["beyond_2se"] else
                           "is within 2 standard errors: the limit falls between two figures the noise does "
                           "not separate"))
    for s in sens:
        k, n = len(s["layers_beyond_2se"]), s["layers"]
        s["chance_expected"], s["chance_p"] = n * P_BEYOND_2SE, binomial_tail(k, n, P_BEYOND_2SE)
        expl.append(f"{s['option']} single-unit sensitivities: rank correlation {s['rank_correlation']:.2f} "
                    f"between the texts; "
                    + (f"{k} of {n} units differ beyond 2 standard errors, where chance alone gives "
                       f"{s['chance_expected']:.1f} on average (probability of {k} or more by chance: "
                       f"{s['chance_p']:.2f})" if k else f"none of {n} units differs beyond 2 standard errors"))
    decisive = [u for u in uniform if u[f"{names[0]}_within_limit"] != u[f"{names[1]}_within_limit"]]
    layer_signal = any(s["chance_p"] < 0.05 / max(len(sens), 1) for s in sens)      # Bonferroni over the options
    if not same and not any(u["beyond_2se"] for u in decisive):
        expl.append("what decides between the recommendations is within the noise: the different choices come from "
                    "where figures with overlapping error bars fall against the limit"
                    + (", although some single-unit sensitivities differ between the texts more often than chance "
                       "would make them" if layer_signal else
                       "; no scheme's single-unit sensitivities differ between the texts more often than chance "
                       "would make them (at 5 %, over all schemes)"))
    elif not same:
        expl.append("the domains differ measurably where it decides: " + "; ".join(
            f"{u['mix']} {describe_degradation(metric, u['difference'], u['difference_se'])} between them"
            for u in decisive if u["beyond_2se"]))
    return {"names": list(names), "same_recommendation": same, "recommendations": [ra["label"], rb["label"]],
            "layers_assigned_differently": diff, "uniform": uniform, "sensitivity": sens, "explanation": expl}


def uniform_on_texts(texts: dict[str, list[list[int]]], schemes: list[str], model=None, device="cpu", dtype=None,
                     metric: str = "ppl") -> list[dict]:
    """Each scheme everywhere (round-to-nearest) on each text's windows, against the
    unquantized model on the same windows: ``{"text", "scheme", "degradation", "se", "tokens"}``.
    With all of a set's evaluation text this has far more tokens than a calibrator run's search
    half, so it can tell whether two domains degrade differently beyond the noise."""
    base = load_model(model, device=device, dtype=dtype).eval()
    rows = []
    for name, windows in texts.items():
        ref = Reference(base, EvalSet.build(windows), exact_match=metric == "exact_match")
        for spec in schemes:
            q = quantize_model(load_model(model, device=device, dtype=dtype).eval(), spec)
            d, se = measure(q, ref)["degradation"][metric]
            rows.append({"text": name, "scheme": spec, "degradation": d, "se": se, "tokens": ref.evalset.tokens,
                         "windows": len(windows)})
    return rows
