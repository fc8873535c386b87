"""The calibrator's stages one by one on a tiny case (the bundled model, one window per part, one
scheme, one precision per decoder block): each stage's typed result, and the whole result's JSON
view with the keys ``workbench calibrate-quant`` has always written."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest

from workbench.data import calibration_set
from workbench.quant.calibrate import build_references, calibrate, load_setup, prepare_data
from workbench.quant.calibrate_stages import (CalibrationData, CalibrationResult, CalibrationSettings, MixBuilder,
                                              Recommendation, References, Search, SearchResult, Sensitivity, confirm,
                                              measure_sensitivity)
from workbench.quant.quality import measure
from workbench.quant.search import DENSE

from tests.conftest import BUNDLED_READY

# the keyword arguments calibrate() took before its settings became a dataclass (all still accepted)
CALIBRATE_KEYWORDS = {
    "target_metric", "max_degradation", "search_space_spec", "objective", "model", "device", "dtype", "text_field",
    "group_field", "context", "eval_windows", "calib_windows", "evaluation_fraction", "em_prompt", "em_tokens",
    "em_prompts", "backend", "memory", "tie_fused", "unit", "max_measured", "decode_steps", "rounds", "latency_rows",
    "sensitivity", "progress", "on_partial", "max_dataset_tokens", "memory_budget"}
# the result JSON's keys, in the order report.json has them
RESULT_KEYS = [
    "dataset", "model", "device", "dtype", "target_metric", "max_degradation", "degradation_units", "objective",
    "memory", "search_space", "backend", "tie_fused", "unit", "units", "threads", "cpu_count", "diagnostics",
    "warnings", "reference", "evaluation", "search_evaluation", "calibration", "sensitivity", "layer_costs",
    "cost_offset", "front", "candidates", "recommendation", "latency", "seconds"]
RECOMMENDATION_KEYS = [
    "key", "label", "recipe", "recipe_fields", "degradation", "degradation_se", "search_degradation",
    "search_degradation_se", "limit", "passes_beyond_noise", "cost", "cost_vs_unquantized", "metrics", "assignment",
    "latency_comparison", "confirmation_tries", "not_confirmed", "reasons"]


def test_settings_hold_every_keyword_calibrate_took_with_the_same_defaults():
    fields = {f.name: f.default for f in dataclasses.fields(CalibrationSettings)}
    assert set(fields) | {"sensitivity", "progress", "on_partial"} == CALIBRATE_KEYWORDS
    params = inspect.signature(calibrate).parameters
    for name in ("target_metric", "max_degradation", "search_space_spec", "objective"):
        assert params[name].default == fields[name], name
    with pytest.raises(TypeError, match="not both"):
        calibrate("x.jsonl", settings=CalibrationSettings(), context=64)
    with pytest.raises(TypeError, match="not both"):
        calibrate("x.jsonl", "kl", settings=CalibrationSettings())
    with pytest.raises(TypeError, match="no_such_option"):
        calibrate("x.jsonl", no_such_option=1)


needs_model = pytest.mark.skipif(not BUNDLED_READY, reason="bundled model weights not present")


@pytest.fixture(scope="module")
def stages():
    """Every stage once, in calibrate()'s order, with the quality measurements counted."""
    settings = CalibrationSettings(search_space_spec="w8a16", context=32, eval_windows=1, calib_windows=1,
                                   max_measured=2, unit="block", backend="reference")
    dataset = calibration_set("reference")
    setup = load_setup(dataset, settings)
    data = prepare_data(dataset, setup)
    refs = build_references(setup, data)
    sens = measure_sensitivity(setup, refs.search, None)
    calls, progress = [], []

    def score(model, reference):
        calls.append(reference)
        return measure(model, reference)

    build = MixBuilder(setup.base, None, settings.backend)
    search = Search(setup, sens, refs.search, build, score,
                    on_progress=lambda r: progress.append((len(r.measured), r.offset))).run()
    n_search = len(calls)
    rec = confirm(setup, sens, search, refs.confirmation, build, score)
    return dict(dataset=dataset, setup=setup, data=data, refs=refs, sens=sens, search=search, rec=rec,
                calls=calls, n_search=n_search, progress=progress)


@needs_model
def test_data_and_reference_stages(stages):
    setup, data, refs = stages["setup"], stages["data"], stages["refs"]
    assert isinstance(data, CalibrationData) and isinstance(refs, References)
    assert set(data.windows) == {"calibration", "search", "confirmation"}
    assert all(len(w) == 1 and len(w[0]) <= 32 for w in data.windows.values())
    assert data.diagnostics["search_windows"] == 1 and data.diagnostics["context"] == setup.settings.context == 32
    assert set(refs.figures()) == {"search", "confirmation"} and refs.figures()["search"]["ppl"] > 1
    assert list(setup.options) == [DENSE, "w8a16"] and not setup.needs_calibration


@needs_model
def test_sensitivity_stage_covers_every_unit_and_option(stages):
    setup, sens = stages["setup"], stages["sens"]
    assert isinstance(sens, Sensitivity)
    assert {(r["layer"], r["option"]) for r in sens.rows} == {(u, "w8a16") for u in setup.units}
    assert set(sens.delta) == set(sens.cost) == {(u, o) for u in setup.units for o in setup.options}
    assert all(v >= 0 for v in sens.delta.values()) and all(sens.delta[(u, DENSE)] == 0 for u in setup.units)
    for u, layers in setup.units.items():         # a unit's cost: its layers' bytes, summed
        per = {(r["layer"], r["option"]): r["bytes"] for r in sens.layer_costs}
        assert sens.cost[(u, "w8a16")] == sum(per[(l, "w8a16")] for l in layers) < sens.cost[(u, DENSE)]


@needs_model
def test_search_stage_measures_each_mix_once_and_reports_progress(stages):
    search = stages["search"]
    assert isinstance(search, SearchResult)
    keys = list(search.measured)
    assert keys[:2] == ["unquantized", "uniform w8a16"] and len(keys) <= 2 + 1      # max_measured 2: one front mix
    assert stages["n_search"] == len(keys)                                           # one measurement per mix
    assert all(r["cost"] == r["bytes"] and r["cost_vs_unquantized"] > 0 for r in search.measured.values())
    assert search.measured["uniform w8a16"]["cost_vs_unquantized"] < 1
    unq = search.measured["unquantized"]
    assert search.offset == unq["cost"] - unq["predicted_cost"]
    # after each measured mix (no offset yet), then once with every cost in
    assert stages["progress"] == [(i + 1, None) for i in range(len(keys))] + [(len(keys), search.offset)]
    assert set(search.front_keys.values()) <= set(keys)


@needs_model
def test_confirm_stage_recommends_a_measured_mix_within_the_limit(stages):
    rec, search, setup = stages["rec"], stages["search"], stages["setup"]
    assert isinstance(rec, Recommendation) and rec.key in search.measured
    assert len(stages["calls"]) == stages["n_search"] + len(rec.confirmation_tries)
    assert all(r is stages["refs"].confirmation for r in stages["calls"][stages["n_search"]:])
    assert rec.degradation == search.measured[rec.key]["confirmation_degradation"] <= setup.limit
    assert rec.reasons and rec.reasons[0].startswith("least measured memory")
    assert list(rec.as_dict()) == RECOMMENDATION_KEYS


@needs_model
def test_result_json_view_has_the_reports_keys(stages):
    s = stages
    res = CalibrationResult.build(s["dataset"], s["setup"], s["data"], s["refs"], s["sens"], s["search"], s["rec"], 0.0)
    d = res.as_dict()
    assert list(d) == RESULT_KEYS == list(res)
    assert d["recommendation"] == s["rec"].as_dict() == res["recommendation"]
    assert res["candidates"] is res.candidates and [c["cost"] for c in res.candidates] == sorted(
        c["cost"] for c in res.candidates)
    assert res.get("unit") == "block" and "front" in res and "nothing" not in res and dict(res) == d
    with pytest.raises(KeyError):
        res["nothing"]
    assert json.loads(json.dumps(d, default=str))["recommendation"]["key"] == s["rec"].key
    partial = CalibrationResult.build(s["dataset"], s["setup"], s["data"], s["refs"], s["sens"], s["search"], None, 0.0)
    assert partial["recommendation"] is None and partial.candidates is not s["search"].measured
    assert [c["key"] for c in partial.candidates] == list(s["search"].measured)          # in the order measured
