"""The precision calibrator: per-layer precision searched against quality *and* measured cost,
on a user's JSONL text (``workbench calibrate-quant``).

::

    res = calibrate("data/calibration/prose.jsonl", target_metric="ppl", max_degradation=0.02,
                    search_space="w8a16,w4a16:g128,w4a8", objective="memory")
    res["recommendation"]["label"], res["recommendation"]["reasons"]
    write_outputs(res, "runs/calib")      # recipe.json, pareto.csv, sensitivity.csv, report.json, recommendation.txt

**Steps** (every number measured in this run):

1. **Data.** The file's rows (:func:`workbench.data.read_jsonl`: a bad line is an error naming it)
   are split by row into a *calibration* part (AWQ / GPTQ / SmoothQuant statistics) and an
   *evaluation* part, itself split into a *search* half (every figure the search decides on)
   and a *confirmation* half (:func:`workbench.data.dataset_split`), packed into windows of
   ``context`` tokens; the
   diagnostics say how many tokens each part has, how long the rows are, and how much of the text
   repeats the evaluation part and the bundled held-out perplexity split (8-token n-grams).
2. **Reference.** The unquantized model on the evaluation windows, once
   (:class:`~workbench.quant.quality.Reference`).
3. **Sensitivity.** Every layer alone under every option of the search space
   (:mod:`workbench.quant.sensitivity`): the target metric's degradation per (layer, option).
4. **Costs.** Every (layer, option) measured (:mod:`workbench.quant.costs`): resident bytes
   (``objective="memory"``) or one matrix-vector product's time (``"latency"``).
5. **Candidates.** The uniform mixes (every layer the same option) and the mixes of the
   predicted Pareto front (:func:`~workbench.quant.search.lagrangian_front`); a binary search
   along the front, cheapest first, finds where the *measured* degradation crosses the limit,
   and more front points fill up to ``max_measured`` measured mixes.  Each measured mix is
   quantized for real (:func:`~workbench.quant.apply.quantize_model`, on ``backend``) and scored
   on the search windows: the quality figures in the table are measured, never summed.
6. **Cost, measured.** ``memory``: the whole model's resident bytes (storages + the backend's
   copies).  ``latency``: single-sequence decode steps of every measured mix and of the
   unquantized model, interleaved over ``rounds`` (each round's median of ``decode_steps`` steps
   is one sample), compared with the noise-aware rule of :mod:`workbench.measure.compare`.
7. **Recommendation.** The measured mix of least cost whose measured degradation is within the
   limit on the search text *and* on the confirmation text (the unquantized model always is),
   with its reasons: which layers kept more precision and why, what the uniform alternatives
   measured, and whether its gain over the unquantized model is beyond the noise.  Choosing the
   cheapest mix that passes on one sample of text favours mixes whose noise happened to help
   there (single-layer deltas of a few tenths of a percent are often below their standard
   error); the confirmation half of the evaluation rows never took part in the choice, so the
   figure reported for the recommendation (and written into its recipe file) is measured on text
   the search did not see.
"""

from __future__ import annotations

import copy
import os
import statistics
import time

import torch

from workbench.errors import ConfigError
from workbench.quant.calibrate_names import DEFAULT_SPACES, OBJECTIVES   # torch-free: the CLI's parser reads them
from workbench.quant.quality import UNITS, EvalSet, Reference, measure, parse_degradation
from workbench.quant.search import DENSE, Mix, lagrangian_front, mix_recipe, search_space, uniform_mix
from workbench.quant.sensitivity import layer_sensitivity, linear_targets

# Host bytes one dataset token takes while the calibrator holds it: its id in a Python list (an int
# object and a pointer) in the diagnostics and the windows, and its 8-gram tuple in the overlap sets
# (two at a time).  Measured: 190 B a token at dataset_diagnostics' peak (tracemalloc, 400k tokens of
# distinct text, bundled tokenizer); doubled for the text itself, the windows and the allocator.
HELD_BYTES_PER_TOKEN = 400
DEFAULT_SPACE = DEFAULT_SPACES["cpu"]


def default_search_space(device) -> str:
    """:data:`DEFAULT_SPACES` of ``device`` ("cpu", "cuda", "cuda:1", a torch.device)."""
    return DEFAULT_SPACES["cuda" if str(device).startswith("cuda") else "cpu"]


def _quantiles(xs: list[int]) -> dict:
    s = sorted(xs)
    q = lambda f: s[min(len(s) - 1, int(f * (len(s) - 1) + 0.5))]  # noqa: E731
    return {"rows": len(s), "min": s[0], "p10": q(0.1), "median": q(0.5), "p90": q(0.9), "max": s[-1]}


def dataset_diagnostics(tokenizer, calib_rows, eval_rows, heldout_eval_ids, heldout_texts=()) -> dict:
    """Token counts, row-length spread and n-gram overlap of a split dataset (see step 1);
    ``heldout_*``: the bundled perplexity split's documents (token ids, texts)."""
    from workbench.data import ngram_overlap

    cal_ids = [tokenizer.encode(r["text"]) for r in calib_rows]
    ev_ids = [tokenizer.encode(r["text"]) for r in eval_rows]
    lengths = [len(x) for x in cal_ids + ev_ids]
    return {"rows": len(lengths), "calibration_rows": len(cal_ids), "evaluation_rows": len(ev_ids),
            "tokens": sum(lengths), "calibration_tokens": sum(map(len, cal_ids)), "evaluation_tokens": sum(map(len, ev_ids)),
            "row_tokens": _quantiles(lengths),
            "overlap_calibration_vs_evaluation_8gram": ngram_overlap(cal_ids, ev_ids, 8) if cal_ids and ev_ids else 0.0,
            "overlap_with_heldout_perplexity_split_8gram": ngram_overlap(cal_ids + ev_ids, heldout_eval_ids, 8),
            "rows_verbatim_in_heldout": sum(any(r["text"] in h for h in heldout_texts) for r in calib_rows + eval_rows)}


def _heldout_eval_ids(tokenizer) -> tuple[list[list[int]], list[str]]:
    """Token ids and texts of the bundled held-out corpus's evaluation documents (the
    perplexity split of :func:`workbench.data.heldout_split`); empty without the corpus."""
    from workbench.data import heldout_documents, heldout_split
    from workbench.errors import WorkbenchError

    try:
        paths = set(heldout_split(tokenizer, 1024)["evaluation_docs"])
        docs = [d for d in heldout_documents() if d["path"] in paths]
    except WorkbenchError:
        return [], []
    return [tokenizer.encode(d["text"]) for d in docs], [d["text"] for d in docs]


def _decode_samples(models: dict, decode_steps: int, rounds: int) -> dict:
    """Each model's decode-step ms: one sample per interleaved round (the median of
    ``decode_steps`` steps), rounds alternating the order (:func:`~workbench.quant.costs.interleaved`)."""
    from workbench.quant.costs import decode_step_ms, interleaved

    samples = interleaved({k: (lambda r, m=m: statistics.median(decode_step_ms(m, steps=decode_steps, seed=r)))
                           for k, m in models.items()}, rounds)
    return {k: {"ms": statistics.median(s), "ms_min": min(s), "ms_max": max(s), "samples": s} for k, s in samples.items()}


def _select(front: list[Mix], measure_mix, limit: float, budget: int) -> list[int]:
    """Indices of ``front`` (cheapest first) to measure: a binary search for the cheapest mix
    whose measured degradation is within ``limit`` (degradation falls along the front, so
    passing is near-monotone in the index), then evenly spaced others up to ``budget``."""
    chosen: list[int] = []
    lo, hi = 0, len(front) - 1
    while lo <= hi and len(chosen) < budget:
        mid = (lo + hi) // 2
        chosen.append(mid)
        if measure_mix(mid) <= limit:
            hi = mid - 1
        else:
            lo = mid + 1
    n_more = budget - len(chosen)
    if n_more > 0 and len(front) > len(chosen):
        step = (len(front) - 1) / max(n_more, 1)
        for j in range(n_more + 1):
            i = int(round(j * step))
            if i not in chosen and len(chosen) < budget:
                chosen.append(i)
                measure_mix(i)
    return chosen


def calibrate(dataset, target_metric: str = "ppl", max_degradation=0.02, search_space_spec=None,
              objective: str = "memory", model=None, device="cpu", dtype=None, text_field: str = "text",
              group_field: str | None = "auto", context: int = 256, eval_windows: int = 8, calib_windows: int = 8,
              evaluation_fraction: float = 0.5, em_prompt: int = 64, em_tokens: int = 4, em_prompts: int = 32,
              backend: str = "auto", memory: str = "stored", tie_fused: bool = True, unit: str = "layer",
              max_measured: int = 10,
              decode_steps: int = 16, rounds: int = 5, latency_rows: int = 1, sensitivity: list[dict] | None = None,
              progress=None, on_partial=None, max_dataset_tokens: int | None = None, memory_budget=None) -> dict:
    """Run the calibrator (see the module docstring); returns a JSON-ready result dict.

    ``memory``: what the memory objective counts - ``"stored"`` (the format's bytes: integers,
    scales, zero points, and every tensor left dense) or ``"resident"`` (also what the backend
    keeps beside them: torch's int4 CPU op its own scales-and-zeros).  ``tie_fused``: q/k/v
    and gate/up of a block get one precision (one unit), as the engines that fuse them need.
    ``unit="block"``: one precision per decoder block (7x fewer sensitivity measurements: a
    first pass on a large model).
    ``sensitivity``: the ``"sensitivity"`` rows of an earlier result on the same model, data,
    evaluation settings, units and search space (e.g. to run the other objective without
    measuring every unit again); they must cover every (unit, option) of this search.
    ``on_partial(result)``: called with the result so far after each measured mix and once every
    mix has its measured cost (``candidates``: the mixes measured until then, in the order
    measured; ``recommendation`` None), so a run stopped part way keeps its rows
    (``workbench calibrate-quant`` saves it for the device check's time cap).

    ``max_dataset_tokens`` (default :data:`workbench.data.DATASET_TOKENS_LIMIT`): the most tokens
    the dataset's rows may hold; the file is read line by line within
    :func:`workbench.data.read_jsonl`'s row and file limits and tokenized row by row, so a file
    past either is refused at its line before the rest is read or tokenized.  What the tokenized
    text then holds in memory (:data:`HELD_BYTES_PER_TOKEN` a token) is checked against the host's
    available memory and ``memory_budget`` (bytes, or ``"8G"``) before the model loads."""
    import workbench
    from workbench.data import DATASET_TOKENS_LIMIT, dataset_split, encode_rows, group_field_of, jsonl_windows, read_jsonl
    from workbench.measure.allocation import check_allocation, format_bytes, parse_bytes
    from workbench.model.loader import BUNDLED_MODEL, load_model
    from workbench.quant.apply import quantize_model, set_quant_backend, weight_bytes
    from workbench.quant.costs import layer_bytes, layer_latency
    from workbench.quant.recommend import recommend
    from workbench.quant.search import expand
    from workbench.quant.sensitivity import layer_units

    t_start = time.perf_counter()
    say = progress or (lambda msg: None)
    if objective not in OBJECTIVES:
        raise ConfigError(f"--objective must be one of {', '.join(OBJECTIVES)}, got {objective!r}")
    if memory not in ("stored", "resident"):
        raise ConfigError(f"memory must be 'stored' or 'resident', got {memory!r}")
    limit = parse_degradation(target_metric, max_degradation)
    options = search_space(search_space_spec or default_search_space(device))
    budget = parse_bytes(memory_budget, "memory_budget (--memory-budget)")
    max_tokens = DATASET_TOKENS_LIMIT if max_dataset_tokens is None else max_dataset_tokens
    for name, v in (("context", context), ("eval_windows", eval_windows), ("calib_windows", calib_windows),
                    ("max_measured", max_measured), ("decode_steps", decode_steps), ("rounds", rounds),
                    ("max_dataset_tokens", max_tokens)):
        if not isinstance(v, int) or v < 1:
            raise ConfigError(f"calibrate: {name} must be an integer >= 1, got {v!r}")
    folder = BUNDLED_MODEL if model in (None, "bundled") else model
    if str(folder).startswith("preset:"):
        raise ConfigError("calibrate: a preset has random weights and no tokenizer: quality cannot be measured on "
                          "it; give a trained model folder")
    from workbench.quant.compressed import is_compressed_checkpoint

    if is_compressed_checkpoint(folder):
        raise ConfigError(f"calibrate: {folder} is a quantized (compressed-tensors) checkpoint; give the unquantized "
                          "model it was made from")
    rows = read_jsonl(dataset, text_field)              # a bad file fails before any model loads
    group = group_field_of(rows, group_field, dataset)
    tok = workbench.Tokenizer(folder)
    # every row is tokenized (diagnostics, windows): bounded first, row by row, then what it holds checked
    tokens = sum(map(len, encode_rows(rows, tok, max_tokens, dataset)))
    check_allocation("calibration data", tokens * HELD_BYTES_PER_TOKEN,
                     "max_dataset_tokens / --max-dataset-tokens (or give a sample of the file)", budget, "cpu",
                     f"{tokens:,} tokens of {dataset} x {format_bytes(HELD_BYTES_PER_TOKEN)} a token (ids and the "
                     "8-gram sets of the overlap diagnostics)")
    base = load_model(folder, device=device, dtype=dtype).eval()
    context = min(context, base.config.max_position_embeddings)
    targets = linear_targets(base)
    units = layer_units(targets, tie_fused, unit)
    sens = None
    if sensitivity is not None:                # given rows must cover this search (checked before any work)
        sens = [dict(r) for r in sensitivity if r["option"] in options]
        have = {(r["layer"], r["option"]) for r in sens}
        lacking = [(u, o) for u in units for o in options if o != DENSE and (u, o) not in have]
        if lacking or any(target_metric not in r for r in sens):
            raise ConfigError(f"calibrate: the given sensitivity rows do not cover this search ({len(lacking)} "
                              f"(unit, option) pairs missing, e.g. {lacking[:2]}, or no {target_metric!r} column)")

    # 1. data
    parts = {k: dataset_split(rows, k, evaluation_fraction, group)
             for k in ("calibration", "evaluation", "search", "confirmation")}
    if min(len(v) for v in parts.values()) == 0:
        what = f"{len({r[group] for r in rows})} {group!r} groups" if group else f"{len(rows)} row(s)"
        raise ConfigError(f"{dataset}: {what}: the calibrator needs at least 4 (calibration, and evaluation split "
                          "into a search half and a confirmation half)")
    heldout_ids, heldout_texts = _heldout_eval_ids(tok)
    diag = dataset_diagnostics(tok, parts["calibration"], parts["evaluation"], heldout_ids, heldout_texts)
    win, spec = {}, {}
    for k, n in (("calibration", calib_windows), ("search", eval_windows), ("confirmation", eval_windows)):
        win[k], spec[k] = jsonl_windows(dataset, tok, context, n, k, evaluation_fraction, text_field, group,
                                        max_tokens=max_tokens)
    diag.update(group_field=group, groups={k: spec[k]["groups"] for k in spec}, context=context,
                **{f"{k}_rows": len(parts[k]) for k in ("search", "confirmation")},
                **{f"{k}_windows": len(win[k]) for k in win}, **{f"{k}_rows_used": spec[k]["rows_used"] for k in spec},
                **{f"{k}_scored_tokens": sum(len(w) - 1 for w in win[k]) for k in ("search", "confirmation")})
    warnings = []
    for k in ("search", "confirmation"):
        if diag[f"{k}_scored_tokens"] < 1000:
            warnings.append(f"only {diag[f'{k}_scored_tokens']} {k} tokens: standard errors will be large")
    if diag["overlap_calibration_vs_evaluation_8gram"] > 0.2:
        warnings.append(f"{100 * diag['overlap_calibration_vs_evaluation_8gram']:.0f}% of the calibration part's 8-grams "
                        "also occur in the evaluation part: quality may be overstated for new text")
    if group is None:
        warnings.append("rows are split one by one (no 'source' field): rows cut from one document can land in "
                        "both halves, which makes the halves less independent than they look (--group-field)")

    # 2. reference
    say("reference: the unquantized model on the search and confirmation windows")
    em = dict(em_prompt=em_prompt, em_tokens=em_tokens, em_prompts=em_prompts)
    ref = Reference(base, EvalSet.build(win["search"], **em), exact_match=target_metric == "exact_match")
    ref_c = Reference(base, EvalSet.build(win["confirmation"], **em), exact_match=target_metric == "exact_match")
    if target_metric == "exact_match" and min(len(ref.evalset.prompts), len(ref_c.evalset.prompts)) < 20:
        warnings.append(f"exact_match on {len(ref.evalset.prompts)} search / {len(ref_c.evalset.prompts)} confirmation "
                        "prompts: each prompt moves the figure by several points (more or longer windows, or "
                        "shorter --em-prompt)")
    needs_cal = any(r is not None and r.needs_calibration for r in options.values())
    calibration = win["calibration"] if needs_cal else None

    # 3. sensitivity, per unit
    t0 = time.perf_counter()
    if sens is None:
        sens = layer_sensitivity(base, ref, options, targets, calibration=calibration, backend=backend,
                                 units=units, progress=say)
    t_sens = time.perf_counter() - t0
    delta = {(u, DENSE): 0.0 for u in units}
    for r in sens:
        delta[(r["layer"], r["option"])] = max(r[target_metric][0], 0.0)      # negative = noise: no gain

    # 4. per-layer costs, summed per unit
    say(f"costs per layer ({objective})")
    t0 = time.perf_counter()
    if objective == "memory":
        raw = layer_bytes(base, targets, options, backend, op_copies=memory == "resident")
        layer_cost = [{"layer": l, "option": o, "bytes": raw[(l, o)]} for l in targets for o in options]
        per_layer = {k: float(v) for k, v in raw.items()}
    else:
        raw = layer_latency(base, targets, options, rows=latency_rows, backend=backend)
        layer_cost = [{"layer": l, "option": o, **raw[(l, o)]} for l in targets for o in options]
        per_layer = {k: v["ms"] for k, v in raw.items()}
    cost = {(u, o): sum(per_layer[(l, o)] for l in ls) for u, ls in units.items() for o in options}
    t_cost = time.perf_counter() - t0

    # 5. candidates, measured
    names = list(options)
    front = lagrangian_front(list(units), names, delta, cost)
    measured: dict[str, dict] = {}
    front_keys: dict[int, str] = {}

    def result(candidates: list[dict], rec: dict | None, offset: float | None) -> dict:
        return {"dataset": str(dataset), "model": str(folder), "device": str(device),
                "dtype": str(next(base.parameters()).dtype), "target_metric": target_metric, "max_degradation": limit,
                "degradation_units": UNITS[target_metric], "objective": objective,
                "memory": memory if objective == "memory" else None, "search_space": names, "backend": backend,
                "tie_fused": tie_fused, "unit": unit, "units": units, "threads": torch.get_num_threads(),
                "cpu_count": os.cpu_count(), "diagnostics": diag, "warnings": warnings,
                "reference": {k: {"ppl": r.ppl, "top1": float(r.top1_hits.double().mean()),
                                  "exact_match": None if r.em_hits is None else float(r.em_hits.mean()),
                                  "tokens": r.evalset.tokens, "prompts": len(r.evalset.prompts)}
                              for k, r in (("search", ref), ("confirmation", ref_c))},
                "evaluation": {**spec["confirmation"], **em}, "search_evaluation": {**spec["search"], **em},
                "calibration": spec["calibration"] if needs_cal else None,
                "sensitivity": sens, "layer_costs": layer_cost, "cost_offset": offset,
                "front": [{"index": i, "label": expand(m, units).label(), "predicted_cost": m.cost,
                           "predicted_degradation": m.degradation, "measured_as": front_keys.get(i)}
                          for i, m in enumerate(front)],
                "candidates": candidates, "recommendation": rec,
                "latency": {"decode_steps": decode_steps, "rounds": rounds, "layer_rows": latency_rows}
                if objective == "latency" else None,
                "seconds": {"sensitivity": t_sens, "layer_costs": t_cost, "total": time.perf_counter() - t_start}}

    def partial(offset: float | None = None) -> None:
        if on_partial is not None:
            on_partial(result([dict(r) for r in measured.values()], None, offset))

    models: dict[str, torch.nn.Module] = {}
    by_assignment: dict[tuple, str] = {}

    def build(row: dict) -> torch.nn.Module:
        if row["recipe_fields"] is None:
            return base
        from workbench.quant.recipe import QuantRecipe

        m = copy.deepcopy(base)
        quantize_model(m, QuantRecipe.from_dict(row["recipe_fields"]), calibration=calibration)
        row["placement"] = set_quant_backend(m, backend)
        return m

    def run_mix(key: str, unit_mix: Mix, kind: str) -> dict:
        mix = expand(unit_mix, units)
        sig = tuple(sorted(mix.assignment.items()))
        if sig in by_assignment:                 # the same mix under another name: measured once
            return measured[by_assignment[sig]]
        by_assignment[sig] = key
        recipe = mix_recipe(mix.assignment, options)
        row = {"key": key, "kind": kind, "label": mix.label(), "counts": mix.counts(), "predicted_cost": mix.cost,
               "predicted_degradation": mix.degradation, "recipe": recipe.name if recipe else None,
               "recipe_fields": recipe.to_dict() if recipe else None, "assignment": mix.assignment}
        if recipe is not None:
            say(f"measure {key}: {mix.label()}")
        m = build(row)
        q = measure(m, ref)
        if objective == "memory":
            stored = weight_bytes(m)["total"]
            op = (row.get("placement") or {}).get("extra_bytes", 0)
            row.update(stored_bytes=stored, op_copy_bytes=op, resident_bytes=stored + op,
                       bytes=stored if memory == "stored" else stored + op)
        else:
            models[key] = m                      # kept for the interleaved decode timing
        d, se = q["degradation"][target_metric]
        row.update(degradation=d, degradation_se=se, passes=d <= limit, passes_beyond_noise=d + 2 * se <= limit,
                   metrics={k: v for k, v in q.items() if k != "degradation"},
                   degradations={k: list(v) for k, v in q["degradation"].items()})
        measured[key] = row
        partial()
        return row

    say("measure the uniform mixes and the predicted front")
    for o in names:
        run_mix("unquantized" if o == DENSE else f"uniform {o}", uniform_mix(list(units), o, delta, cost), "uniform")
    def measure_front(i: int) -> float:
        row = run_mix(f"front {i}", front[i], "front")
        front_keys[i] = row["key"]
        return row["degradation"]

    _select(front, measure_front, limit, max(1, max_measured - len(names)))

    # 6. measured cost of every measured mix
    if objective == "latency":
        say(f"decode steps of {len(models)} models, {rounds} interleaved rounds")
        for k, c in _decode_samples(models, decode_steps, rounds).items():
            measured[k].update(c)
    for row in measured.values():
        row["cost"] = row["bytes"] if objective == "memory" else row["ms"]
    unq = measured["unquantized"]
    for row in measured.values():
        row["cost_vs_unquantized"] = row["cost"] / unq["cost"] if unq["cost"] else float("nan")
        row["pareto"] = not any(o is not row and o["cost"] <= row["cost"] and o["degradation"] <= row["degradation"]
                                and (o["cost"] < row["cost"] or o["degradation"] < row["degradation"])
                                for o in measured.values())
    # what the per-layer costs leave out (norms, embedding, attention...): the measured total of the
    # unquantized model minus its summed dense layers, so predictions can be drawn on the measured axis
    offset = unq["cost"] - unq["predicted_cost"]
    partial(offset)                              # every measured mix with its measured cost, before the confirmation

    # 7. recommendation: picked on the search text, confirmed on the confirmation text
    say("confirm the pick on the confirmation text")

    def confirm(row: dict) -> tuple[float, float]:
        m = models.get(row["key"]) or build(row)
        q = measure(m, ref_c)
        row["confirmation_metrics"] = {k: v for k, v in q.items() if k != "degradation"}
        return tuple(q["degradation"][target_metric])

    best, tries = recommend(list(measured.values()), confirm, limit, objective)
    verdict = None
    if objective == "latency" and best["key"] != "unquantized":
        from workbench.measure.compare import compare_samples

        cmpn = compare_samples(best["samples"], unq["samples"], names=("recommended", "unquantized"))
        verdict = cmpn.as_dict()
        best["verdict_vs_unquantized"] = cmpn.verdict
    rec = {"key": best["key"], "label": best["label"], "recipe": best["recipe"], "recipe_fields": best["recipe_fields"],
           "degradation": best["confirmation_degradation"], "degradation_se": best["confirmation_degradation_se"],
           "search_degradation": best["degradation"], "search_degradation_se": best["degradation_se"], "limit": limit,
           "passes_beyond_noise": best["confirmation_degradation"] + 2 * best["confirmation_degradation_se"] <= limit,
           "cost": best["cost"], "cost_vs_unquantized": best["cost_vs_unquantized"],
           "metrics": best.get("confirmation_metrics") or best["metrics"], "assignment": best["assignment"],
           "latency_comparison": verdict, "confirmation_tries": [r["key"] for r in tries],
           "not_confirmed": [r["key"] for r in tries if not r["confirmed"]]}
    from workbench.quant.calibrate_report import reasons

    rec["reasons"] = reasons(rec, measured, sens, target_metric, objective, limit, cost=cost, units=units)

    return result(sorted(measured.values(), key=lambda r: r["cost"]), rec, offset)
