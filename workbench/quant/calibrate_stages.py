"""The precision calibrator's stages, each with a typed result (:func:`workbench.quant.calibrate.calibrate`
runs them in order; its module docstring says what each step measures).

::

    sens = measure_sensitivity(setup, reference, calibration)          # -> Sensitivity   (steps 3, 4)
    search = Search(setup, sens, reference, MixBuilder(...)).run()       # -> SearchResult  (steps 5, 6)
    rec = confirm(setup, sens, search, confirmation_reference, builder)  # -> Recommendation (step 7)

:class:`CalibrationSettings` is what a run is asked for (``calibrate``'s keyword arguments);
:class:`CalibrationResult` is what it found: ``result.as_dict()`` is the JSON that
``workbench calibrate-quant`` writes, and ``result["key"]`` reads that JSON view.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from collections.abc import Callable

import torch

from workbench.errors import ConfigError
from workbench.quant.quality import UNITS, Reference
from workbench.quant.search import DENSE, Mix, expand, lagrangian_front, mix_recipe, uniform_mix
from workbench.quant.sensitivity import layer_sensitivity
from workbench.measure.compare import compare_samples
from workbench.quant.apply import quantize_model, set_quant_backend, weight_bytes
from workbench.quant.costs import decode_step_ms, interleaved, layer_bytes, layer_latency
from workbench.quant.recipe import QuantRecipe


@dataclass(frozen=True)
class CalibrationSettings:
    """What one calibrator run is asked for (``calibrate``'s keyword arguments, same names and defaults).

    ``memory``: what the memory objective counts - ``"stored"`` (the format's bytes: integers,
    scales, zero points, and every tensor left dense) or ``"resident"`` (also what the backend
    keeps beside them: torch's int4 CPU op its own scales-and-zeros).  ``tie_fused``: q/k/v
    and gate/up of a block get one precision (one unit), as the engines that fuse them need.
    ``unit="block"``: one precision per decoder block (7x fewer sensitivity measurements: a
    first pass on a large model).  ``max_dataset_tokens`` (default
    :data:`workbench.data.DATASET_TOKENS_LIMIT`): the most tokens the dataset's rows may hold;
    ``memory_budget`` (bytes, or ``"8G"``): the most host memory the tokenized text may take."""

    # the target and the objective
    target_metric: str = "ppl"
    max_degradation: float | str = 0.02
    search_space_spec: str | None = None
    objective: str = "memory"
    memory: str = "stored"
    # the model and where its quantized layers run
    model: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    backend: str = "auto"
    tie_fused: bool = True
    unit: str = "layer"
    # the data: its rows, their split, the windows
    text_field: str = "text"
    group_field: str | None = "auto"
    context: int = 256
    eval_windows: int = 8
    calib_windows: int = 8
    evaluation_fraction: float = 0.5
    em_prompt: int = 64
    em_tokens: int = 4
    em_prompts: int = 32
    max_dataset_tokens: int | None = None
    memory_budget: int | str | None = None
    # the search and the latency measurements
    max_measured: int = 10
    decode_steps: int = 16
    rounds: int = 5
    latency_rows: int = 1

    @property
    def exact_match(self) -> dict:
        """The exact-match prompt settings, as :meth:`~workbench.quant.quality.EvalSet.build` takes them."""
        return dict(em_prompt=self.em_prompt, em_tokens=self.em_tokens, em_prompts=self.em_prompts)


@dataclass
class Setup:
    """What every stage works on: the checked settings, the data's rows and the loaded model."""

    settings: CalibrationSettings            # ``context`` already within the model's positions
    limit: float                             # the target metric's limit, parsed
    options: dict                            # option -> QuantRecipe (None: dense), the search space
    folder: str                              # the model folder
    rows: list[dict]
    group: str | None                        # the field rows are grouped by in the split
    tokenizer: object
    max_tokens: int
    base: torch.nn.Module                    # the unquantized model
    targets: list[str]                       # its linear layers
    units: dict[str, list[str]]              # unit -> layers that get one precision
    given_sensitivity: list[dict] | None     # earlier rows covering this search, checked

    @property
    def needs_calibration(self) -> bool:
        """Whether an option of the search space computes statistics on the calibration windows."""
        return any(r is not None and r.needs_calibration for r in self.options.values())


@dataclass
class CalibrationData:
    """Step 1: the dataset split into calibration / search / confirmation parts and their windows."""

    parts: dict[str, list[dict]]             # "calibration", "evaluation", "search", "confirmation" -> rows
    diagnostics: dict                        # token counts, row lengths, overlaps (the result's "diagnostics")
    windows: dict[str, list[list[int]]]      # "calibration", "search", "confirmation" -> token windows
    specs: dict[str, dict]                   # the same -> how the windows were cut (recipe files keep it)
    warnings: list[str]


@dataclass
class References:
    """Step 2: the unquantized model on the search and on the confirmation windows."""

    search: Reference
    confirmation: Reference

    def figures(self) -> dict:
        """The result's ``"reference"``: ppl, top-1, exact match, tokens and prompts of each."""
        return {k: {"ppl": r.ppl, "top1": float(r.top1_hits.double().mean()),
                    "exact_match": None if r.em_hits is None else float(r.em_hits.mean()),
                    "tokens": r.evalset.tokens, "prompts": len(r.evalset.prompts)}
                for k, r in (("search", self.search), ("confirmation", self.confirmation))}


# ---- steps 3 and 4: sensitivity and per-layer costs ---------------------------------------------------

@dataclass
class Sensitivity:
    """Every unit alone under every option: its measured degradation and its summed per-layer cost."""

    rows: list[dict]                         # the result's "sensitivity" (given, or measured now)
    delta: dict[tuple[str, str], float]      # (unit, option) -> degradation, negative (noise) as 0
    layer_costs: list[dict]                  # the result's "layer_costs": one row per (layer, option)
    cost: dict[tuple[str, str], float]       # (unit, option) -> bytes or ms, summed over its layers
    seconds_sensitivity: float
    seconds_costs: float


def check_given_sensitivity(rows: list[dict], units: dict, options: dict, metric: str) -> list[dict]:
    """The rows of an earlier result that belong to this search space, refused unless they cover
    every (unit, option) pair and have the target metric."""
    sens = [dict(r) for r in rows if r["option"] in options]
    have = {(r["layer"], r["option"]) for r in sens}
    lacking = [(u, o) for u in units for o in options if o != DENSE and (u, o) not in have]
    if lacking or any(metric not in r for r in sens):
        raise ConfigError(f"calibrate: the given sensitivity rows do not cover this search ({len(lacking)} "
                          f"(unit, option) pairs missing, e.g. {lacking[:2]}, or no {metric!r} column)")
    return sens


def measure_sensitivity(setup: Setup, reference: Reference, calibration, say=None) -> Sensitivity:
    """Steps 3 and 4: each unit alone under each option against ``reference`` (or the checked
    rows given), then each (layer, option)'s bytes or matrix-vector time, summed per unit."""
    s, say = setup.settings, say or (lambda msg: None)
    t0 = time.perf_counter()
    rows = setup.given_sensitivity
    if rows is None:
        rows = layer_sensitivity(setup.base, reference, setup.options, setup.targets, calibration=calibration,
                                 backend=s.backend, units=setup.units, progress=say)
    t_sens = time.perf_counter() - t0
    delta = {(u, DENSE): 0.0 for u in setup.units}
    for r in rows:
        delta[(r["layer"], r["option"])] = max(r[s.target_metric][0], 0.0)      # negative = noise: no gain
    say(f"costs per layer ({s.objective})")
    t0 = time.perf_counter()
    targets, options = setup.targets, setup.options
    if s.objective == "memory":
        raw = layer_bytes(setup.base, targets, options, s.backend, op_copies=s.memory == "resident")
        layer_cost = [{"layer": l, "option": o, "bytes": raw[(l, o)]} for l in targets for o in options]
        per_layer = {k: float(v) for k, v in raw.items()}
    else:
        raw = layer_latency(setup.base, targets, options, rows=s.latency_rows, backend=s.backend)
        layer_cost = [{"layer": l, "option": o, **raw[(l, o)]} for l in targets for o in options]
        per_layer = {k: v["ms"] for k, v in raw.items()}
    cost = {(u, o): sum(per_layer[(l, o)] for l in ls) for u, ls in setup.units.items() for o in options}
    return Sensitivity(rows, delta, layer_cost, cost, t_sens, time.perf_counter() - t0)


# ---- steps 5 and 6: the mixes, quantized and measured --------------------------------------------------

@dataclass
class MixBuilder:
    """A measured row's model: the unquantized model itself, or a quantized copy of it (on ``backend``)."""

    base: torch.nn.Module
    calibration: list | None                 # calibration windows, when an option needs them
    backend: str

    def __call__(self, row: dict) -> torch.nn.Module:
        if row["recipe_fields"] is None:
            return self.base

        m = copy.deepcopy(self.base)
        quantize_model(m, QuantRecipe.from_dict(row["recipe_fields"]), calibration=self.calibration)
        row["placement"] = set_quant_backend(m, self.backend)
        return m


@dataclass
class SearchResult:
    """The measured mixes (so far, while the search runs)."""

    front: list[Mix]                         # the predicted Pareto front over units, cheapest first
    front_keys: dict[int, str]               # front index -> key of the row it was measured as
    measured: dict[str, dict]                # key -> row (the result's "candidates"), in the order measured
    models: dict[str, torch.nn.Module]       # latency: each measured mix's model (kept for the confirmation)
    offset: float | None = None              # measured total minus summed dense layers (once costs are in)

    def front_rows(self, units: dict) -> list[dict]:
        """The result's ``"front"``: each front mix with its prediction and the row it was measured as."""
        return [{"index": i, "label": expand(m, units).label(), "predicted_cost": m.cost,
                 "predicted_degradation": m.degradation, "measured_as": self.front_keys.get(i)}
                for i, m in enumerate(self.front)]


class Search:
    """Steps 5 and 6: the uniform mixes and the front's mixes, quantized for real and scored on the
    search windows (``score``: :func:`~workbench.quant.quality.measure`), then each one's cost
    measured; ``on_progress(result so far)`` after each measured mix and once the costs are in."""

    def __init__(self, setup: Setup, sens: Sensitivity, reference: Reference, build: MixBuilder,
                 score: Callable, say=None, on_progress=None):
        self.setup, self.sens, self.reference, self.build, self.score = setup, sens, reference, build, score
        self.say = say or (lambda msg: None)
        self.on_progress = on_progress or (lambda result: None)
        self.result = SearchResult(lagrangian_front(list(setup.units), list(setup.options), sens.delta, sens.cost),
                                   {}, {}, {})
        self._by_assignment: dict[tuple, str] = {}

    def run(self) -> SearchResult:
        s, names, res = self.setup.settings, list(self.setup.options), self.result
        self.say("measure the uniform mixes and the predicted front")
        for o in names:
            self.measure_mix("unquantized" if o == DENSE else f"uniform {o}",
                             uniform_mix(list(self.setup.units), o, self.sens.delta, self.sens.cost), "uniform")

        def measure_front(i: int) -> float:
            row = self.measure_mix(f"front {i}", res.front[i], "front")
            res.front_keys[i] = row["key"]
            return row["degradation"]

        _select(res.front, measure_front, self.setup.limit, max(1, s.max_measured - len(names)))
        self._measure_costs()
        return res

    def measure_mix(self, key: str, unit_mix: Mix, kind: str) -> dict:
        """One mix quantized, scored on the search windows and (memory) its bytes counted: its row."""
        s, measured = self.setup.settings, self.result.measured
        mix = expand(unit_mix, self.setup.units)
        sig = tuple(sorted(mix.assignment.items()))
        if sig in self._by_assignment:           # the same mix under another name: measured once
            return measured[self._by_assignment[sig]]
        self._by_assignment[sig] = key
        recipe = mix_recipe(mix.assignment, self.setup.options)
        row = {"key": key, "kind": kind, "label": mix.label(), "counts": mix.counts(), "predicted_cost": mix.cost,
               "predicted_degradation": mix.degradation, "recipe": recipe.name if recipe else None,
               "recipe_fields": recipe.to_dict() if recipe else None, "assignment": mix.assignment}
        if recipe is not None:
            self.say(f"measure {key}: {mix.label()}")
        m = self.build(row)
        q = self.score(m, self.reference)
        if s.objective == "memory":
            stored = weight_bytes(m)["total"]
            op = (row.get("placement") or {}).get("extra_bytes", 0)
            row.update(stored_bytes=stored, op_copy_bytes=op, resident_bytes=stored + op,
                       bytes=stored if s.memory == "stored" else stored + op)
        else:
            self.result.models[key] = m          # kept for the interleaved decode timing
        d, se = q["degradation"][s.target_metric]
        limit = self.setup.limit
        row.update(degradation=d, degradation_se=se, passes=d <= limit, passes_beyond_noise=d + 2 * se <= limit,
                   metrics={k: v for k, v in q.items() if k != "degradation"},
                   degradations={k: list(v) for k, v in q["degradation"].items()})
        measured[key] = row
        self.on_progress(self.result)
        return row

    def _measure_costs(self) -> None:
        """Step 6: each measured mix's cost (latency: interleaved decode steps), its ratio to the
        unquantized model's, the Pareto flag, and the offset the per-layer costs leave out."""
        s, res = self.setup.settings, self.result
        measured = res.measured
        if s.objective == "latency":
            self.say(f"decode steps of {len(res.models)} models, {s.rounds} interleaved rounds")
            for k, c in _decode_samples(res.models, s.decode_steps, s.rounds).items():
                measured[k].update(c)
        for row in measured.values():
            row["cost"] = row["bytes"] if s.objective == "memory" else row["ms"]
        unq = measured["unquantized"]
        for row in measured.values():
            row["cost_vs_unquantized"] = row["cost"] / unq["cost"] if unq["cost"] else float("nan")
            row["pareto"] = not any(o is not row and o["cost"] <= row["cost"] and o["degradation"] <= row["degradation"]
                                    and (o["cost"] < row["cost"] or o["degradation"] < row["degradation"])
                                    for o in measured.values())
        # what the per-layer costs leave out (norms, embedding, attention...): the measured total of the
        # unquantized model minus its summed dense layers, so predictions can be drawn on the measured axis
        res.offset = unq["cost"] - unq["predicted_cost"]
        self.on_progress(res)                    # every measured mix with its measured cost, before the confirmation


def _decode_samples(models: dict, decode_steps: int, rounds: int) -> dict:
    """Each model's decode-step ms: one sample per interleaved round (the median of
    ``decode_steps`` steps), rounds alternating the order (:func:`~workbench.quant.costs.interleaved`)."""
    samples = interleaved({k: (lambda r, m=m: statistics.median(decode_step_ms(m, steps=decode_steps, seed=r)))
                           for k, m in models.items()}, rounds)
    return {k: {"ms": statistics.median(s), "ms_min": min(s), "ms_max": max(s), "samples": s}
            for k, s in samples.items()}


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


# ---- step 7: the recommendation, confirmed -------------------------------------------------------------

@dataclass
class Recommendation:
    """The measured mix recommended (:func:`confirm`); its figures are on the confirmation text."""

    key: str
    label: str
    recipe: str | None
    recipe_fields: dict | None               # None: the unquantized model
    degradation: float                       # on the confirmation text
    degradation_se: float
    search_degradation: float
    search_degradation_se: float
    limit: float
    passes_beyond_noise: bool                # on the confirmation text, by 2 standard errors
    cost: float
    cost_vs_unquantized: float
    metrics: dict
    assignment: dict[str, str]
    latency_comparison: dict | None          # latency: against the unquantized model's decode steps
    confirmation_tries: list[str]
    not_confirmed: list[str]
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        """The result JSON's ``"recommendation"``."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


def confirm(setup: Setup, sens: Sensitivity, search: SearchResult, reference: Reference, build: MixBuilder,
            score: Callable) -> Recommendation:
    """Step 7: the pick of :func:`workbench.quant.recommend.recommend` (on the search text),
    measured on the confirmation text (``reference``) with its fallbacks, and the reasons for it."""
    from workbench.quant.calibrate_report import reasons  # lazy: calibrate_report imports this module (a cycle)

    s, limit, measured = setup.settings, setup.limit, search.measured

    def look(row: dict) -> tuple[float, float]:
        m = search.models.get(row["key"]) or build(row)
        q = score(m, reference)
        row["confirmation_metrics"] = {k: v for k, v in q.items() if k != "degradation"}
        return tuple(q["degradation"][s.target_metric])

    # looked up per call: tests stop a run inside it (tests/bench/test_partial_results.py patches the module)
    from workbench.quant.recommend import recommend

    best, tries = recommend(list(measured.values()), look, limit, s.objective)
    verdict = None
    if s.objective == "latency" and best["key"] != "unquantized":
        cmpn = compare_samples(best["samples"], measured["unquantized"]["samples"],
                               names=("recommended", "unquantized"))
        verdict = cmpn.as_dict()
        best["verdict_vs_unquantized"] = cmpn.verdict
    d, se = best["confirmation_degradation"], best["confirmation_degradation_se"]
    rec = Recommendation(
        key=best["key"], label=best["label"], recipe=best["recipe"], recipe_fields=best["recipe_fields"],
        degradation=d, degradation_se=se, search_degradation=best["degradation"],
        search_degradation_se=best["degradation_se"], limit=limit, passes_beyond_noise=d + 2 * se <= limit,
        cost=best["cost"], cost_vs_unquantized=best["cost_vs_unquantized"],
        metrics=best.get("confirmation_metrics") or best["metrics"], assignment=best["assignment"],
        latency_comparison=verdict, confirmation_tries=[r["key"] for r in tries],
        not_confirmed=[r["key"] for r in tries if not r["confirmed"]])
    rec.reasons = reasons({k: v for k, v in rec.as_dict().items() if k != "reasons"}, measured, sens.rows,
                          s.target_metric, s.objective, limit, cost=sens.cost, units=setup.units)
    return rec


# ---- the whole result -----------------------------------------------------------------------------------

@dataclass
class CalibrationResult(Mapping):
    """What a calibrator run found.  :meth:`as_dict` is its JSON (``report.json``, ``--json``);
    ``result["key"]`` (and ``.get``, ``in``, iteration) reads that JSON view, for callers written
    against the dict."""

    dataset: str
    model: str
    device: str
    dtype: str
    target_metric: str
    max_degradation: float
    degradation_units: str
    objective: str
    memory: str | None                       # memory objective: "stored" or "resident"
    search_space: list[str]
    backend: str
    tie_fused: bool
    unit: str
    units: dict[str, list[str]]
    threads: int
    cpu_count: int | None
    diagnostics: dict
    warnings: list[str]
    reference: dict
    evaluation: dict                         # the confirmation windows' spec (recipe files rebuild them)
    search_evaluation: dict
    calibration: dict | None
    sensitivity: list[dict]
    layer_costs: list[dict]
    cost_offset: float | None
    front: list[dict]
    candidates: list[dict]                   # the measured mixes, cheapest first
    recommendation: Recommendation | None    # None in a partial result
    latency: dict | None
    seconds: dict

    @classmethod
    def build(cls, dataset, setup: Setup, data: CalibrationData, refs: References, sens: Sensitivity,
              search: SearchResult, rec: Recommendation | None, t_start: float) -> CalibrationResult:
        """The result from the stages' results (``rec`` None: a partial one, the candidates copied
        in the order measured; else cheapest first)."""
        s = setup.settings
        rows = search.measured.values()
        em = s.exact_match
        return cls(
            dataset=str(dataset), model=str(setup.folder), device=str(s.device),
            dtype=str(next(setup.base.parameters()).dtype), target_metric=s.target_metric,
            max_degradation=setup.limit, degradation_units=UNITS[s.target_metric], objective=s.objective,
            memory=s.memory if s.objective == "memory" else None, search_space=list(setup.options),
            backend=s.backend, tie_fused=s.tie_fused, unit=s.unit, units=setup.units,
            threads=torch.get_num_threads(), cpu_count=os.cpu_count(), diagnostics=data.diagnostics,
            warnings=data.warnings, reference=refs.figures(), evaluation={**data.specs["confirmation"], **em},
            search_evaluation={**data.specs["search"], **em},
            calibration=data.specs["calibration"] if setup.needs_calibration else None,
            sensitivity=sens.rows, layer_costs=sens.layer_costs, cost_offset=search.offset,
            front=search.front_rows(setup.units),
            candidates=[dict(r) for r in rows] if rec is None else sorted(rows, key=lambda r: r["cost"]),
            recommendation=rec,
            latency={"decode_steps": s.decode_steps, "rounds": s.rounds, "layer_rows": s.latency_rows}
            if s.objective == "latency" else None,
            seconds={"sensitivity": sens.seconds_sensitivity, "layer_costs": sens.seconds_costs,
                     "total": time.perf_counter() - t_start})

    def as_dict(self) -> dict:
        """The JSON view: the keys and values ``workbench calibrate-quant`` writes into ``report.json``."""
        return {name: self[name] for name in _RESULT_KEYS}

    def __getitem__(self, key: str):
        if key not in _RESULT_KEYS:
            raise KeyError(key)
        v = getattr(self, key)
        return v.as_dict() if isinstance(v, Recommendation) else v

    def __iter__(self):
        return iter(_RESULT_KEYS)

    def __len__(self) -> int:
        return len(_RESULT_KEYS)


_RESULT_KEYS = tuple(f.name for f in dataclasses.fields(CalibrationResult))


def result_dict(res) -> dict:
    """A calibrator result as its JSON dict (a :class:`CalibrationResult`, or that dict already)."""
    return res.as_dict() if isinstance(res, CalibrationResult) else res
