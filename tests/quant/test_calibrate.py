"""The precision calibrator end to end on a shipped calibration set (small windows), and its
parts: the quality metrics against the unquantized model, the per-layer sensitivity, the
Lagrangian front against brute force, mixes as recipes, measured costs."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest
import torch

import workbench
from workbench.cli.main import main
from workbench.data import calibration_set, jsonl_windows
from workbench.errors import ConfigError
from workbench.model.loader import load_model
from workbench.quant.apply import QuantLinear, quantize_model, set_quant_backend, weight_bytes
from workbench.quant.calibrate_report import check_reported, compare_domains
from workbench.quant.costs import layer_bytes
from workbench.quant.quality import EvalSet, Reference, greedy_continuations, measure, parse_degradation
from workbench.quant.recipe import QuantRecipe, load_recipe
from workbench.quant.search import DENSE, lagrangian_front, mix_recipe, search_space
from workbench.quant.sensitivity import layer_sensitivity, linear_targets

from tests.conftest import BUNDLED_READY

pytestmark = pytest.mark.skipif(not BUNDLED_READY, reason="bundled model weights not present")
SMALL = ["--context", "64", "--eval-windows", "3", "--calib-windows", "2", "--search-space", "w8a16,w4a16:g128",
         "--max-measured", "5", "--backend", "reference"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One calibrator run through the CLI (memory objective, ppl within 2 %) on the prose set."""
    out = tmp_path_factory.mktemp("calib")
    rc = main(["calibrate-quant", "--dataset", "prose", "--max-degradation", "2%", "--objective", "memory",
               "--out", str(out), "--quiet", *SMALL])
    assert rc == 0
    return out, json.loads((out / "report.json").read_text())


def test_cli_writes_every_output(run):
    out, res = run
    for name in ("recipe.json", "pareto.csv", "pareto.html", "sensitivity.csv", "layer_costs.csv", "report.json",
                 "recommendation.txt"):
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    assert "recommendation (memory, ppl within +2.00 %)" in (out / "recommendation.txt").read_text()
    d = res["diagnostics"]
    assert d["search_rows"] + d["confirmation_rows"] == d["evaluation_rows"]
    assert d["calibration_rows"] + d["evaluation_rows"] == d["rows"] == 64
    assert d["search_windows"] == d["confirmation_windows"] == 3 and d["context"] == 64
    assert 0 <= d["overlap_with_heldout_perplexity_split_8gram"] < 0.05 and d["rows_verbatim_in_heldout"] == 0


def test_recommendation_holds_on_both_halves_and_is_the_cheapest_confirmed(run):
    _, res = run
    rec, limit = res["recommendation"], res["max_degradation"]
    cands = {c["key"]: c for c in res["candidates"]}
    best = cands[rec["key"]]
    assert best["passes"] and best["confirmed"] and rec["degradation"] == best["confirmation_degradation"] <= limit
    # every cheaper mix either failed on the search text or was tried on the confirmation text and failed
    for c in res["candidates"]:
        if c["cost"] < best["cost"]:
            assert not c["passes"] or c.get("confirmed") is False, c["key"]
    assert cands["unquantized"]["degradation"] == 0 and cands["unquantized"]["cost_vs_unquantized"] == 1
    for c in res["candidates"]:                      # the Pareto flag: no other mix is at least as good on both
        dominated = any(o is not c and o["cost"] <= c["cost"] and o["degradation"] <= c["degradation"]
                        and (o["cost"] < c["cost"] or o["degradation"] < c["degradation"]) for o in res["candidates"])
        assert c["pareto"] == (not dominated)


def test_llm_reproduces_the_reported_figure_and_bytes(run):
    out, res = run
    recipe, doc = load_recipe(out / "recipe.json")
    assert doc["reported"]["degradation"] == res["recommendation"]["degradation"]
    llm = workbench.LLM(quant=str(out / "recipe.json"), quant_backend="reference")
    assert llm.model.recipe == recipe
    got = check_reported(doc, llm.model, load_model(device="cpu").eval(), llm.tokenizer)
    assert abs(got["difference"]) <= 1e-9, got
    assert weight_bytes(llm.model)["total"] == res["recommendation"]["cost"]      # the memory objective's figure
    # each layer got the option the assignment names
    for layer, opt in res["recommendation"]["assignment"].items():
        mod = llm.model.get_submodule(layer)
        if opt == DENSE:
            assert isinstance(mod, torch.nn.Linear)
        else:
            assert isinstance(mod, QuantLinear) and mod.bits == QuantRecipe.parse(opt).weight_bits


def test_latency_objective_reuses_sensitivity_and_compares_against_the_noise(run):
    from workbench.quant.calibrate import calibrate

    _, res = run
    lat = calibrate(calibration_set("prose"), "ppl", "2%", "w8a16,w4a16:g128", objective="latency", context=64,
                    eval_windows=3, calib_windows=2, max_measured=3, decode_steps=2, rounds=3, backend="reference",
                    sensitivity=res["sensitivity"])
    assert lat["seconds"]["sensitivity"] < 1.0                 # reused, not measured again
    for c in lat["candidates"]:
        assert len(c["samples"]) == 3 and c["ms_min"] <= c["ms"] <= c["ms_max"]
    rec = lat["recommendation"]
    if rec["key"] != "unquantized":
        assert rec["latency_comparison"]["verdict"]
    with pytest.raises(ConfigError, match="do not cover this search"):
        calibrate(calibration_set("prose"), "ppl", "2%", "w8a16,w4a8", objective="latency", context=64,
                  eval_windows=3, calib_windows=2, sensitivity=res["sensitivity"])
    cmp = compare_domains(res, {**res}, ("a", "b"))
    assert cmp["same_recommendation"] and not cmp["layers_assigned_differently"]


@pytest.fixture(scope="module")
def small():
    tok = workbench.Tokenizer(workbench.BUNDLED_MODEL)
    w, _ = jsonl_windows(calibration_set("reference"), tok, 64, 2, "search")
    model = load_model(device="cpu").eval()
    return model, EvalSet.build(w, em_prompt=16, em_tokens=3, em_prompts=6)


def test_metrics_of_the_reference_itself_are_zero_and_of_a_quantized_model_consistent(small):
    model, ev = small
    ref = Reference(model, ev, exact_match=True)
    same = measure(model, ref)
    assert all(v == (0.0, 0.0) or v[0] == 0 for v in same["degradation"].values()), same["degradation"]
    assert same["agreement"] == 1 and same["exact_match"] == same["exact_match_ref"]
    q = quantize_model(load_model(device="cpu").eval(), "w4a16:pt")         # per tensor: clearly worse
    r = measure(q, ref)
    assert r["kl"] > 0 and r["agreement"] < 1 and r["prompts"] == 6
    assert r["degradation"]["ppl"][0] == pytest.approx(r["ppl"] / r["ppl_ref"] - 1)
    assert r["degradation"]["top1"][0] == pytest.approx(100 * (r["top1_ref"] - r["top1"]))
    assert r["degradation"]["exact_match"][0] == pytest.approx(100 * (r["exact_match_ref"] - r["exact_match"]))


def test_batched_greedy_continuations_equal_one_at_a_time(small):
    model, ev = small
    batched = greedy_continuations(model, ev.prompts, 3)
    assert batched == [greedy_continuations(model, [p], 3)[0] for p in ev.prompts]
    assert ev.targets and all(len(t) == 3 for t in ev.targets) and all(len(p) == 16 for p in ev.prompts)


def test_sensitivity_leaves_the_model_as_it_was(small):
    model, ev = small
    ref = Reference(model, ev)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    targets = linear_targets(model)[:3]
    rows = layer_sensitivity(model, ref, search_space("w4a16:g128"), targets)
    assert [r["layer"] for r in rows] == targets and all(r["option"] == "w4a16:g128" for r in rows)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the in-place swap measures what quantize_model builds
    only = QuantRecipe.parse("w4a16:g128")
    q = quantize_model(load_model(device="cpu").eval(),
                       dataclasses.replace(only, skip=only.skip + tuple(linear_targets(model)[1:])))
    assert measure(q, ref)["degradation"]["ppl"] == pytest.approx(rows[0]["ppl"])


def test_lagrangian_front_matches_brute_force():
    layers, opts = ["a", "b", "c"], ["dense", "x", "y"]
    cost = {("a", "dense"): 4, ("a", "x"): 2, ("a", "y"): 1, ("b", "dense"): 4, ("b", "x"): 3, ("b", "y"): 1,
            ("c", "dense"): 4, ("c", "x"): 1.5, ("c", "y"): 1}
    delta = {("a", "dense"): 0, ("a", "x"): 0.1, ("a", "y"): 0.5, ("b", "dense"): 0, ("b", "x"): 0.05,
             ("b", "y"): 0.2, ("c", "dense"): 0, ("c", "x"): 0.3, ("c", "y"): 0.31}
    front = lagrangian_front(layers, opts, delta, cost)
    assert [m.cost for m in front] == sorted(m.cost for m in front)
    assert all(x.degradation >= y.degradation for x, y in zip(front, front[1:]))
    allmix = [dict(zip(layers, c)) for c in itertools.product(opts, repeat=3)]
    keys = {tuple(sorted(m.assignment.items())) for m in front}
    for lam in (0.0, 0.5, 3, 7, 10, 50, 1e6):       # each lambda's brute-force optimum is on the front
        score = lambda a: sum(cost[(l, o)] + lam * delta[(l, o)] for l, o in a.items())  # noqa: E731
        best = min(score(a) for a in allmix)
        assert any(abs(score(dict(k)) - best) < 1e-9 for k in keys), lam
    assert front[0].assignment == {"a": "y", "b": "y", "c": "y"}
    assert front[-1].assignment == dict.fromkeys(layers, "dense")


def test_mix_recipe_and_search_space():
    opts = search_space("w8a16,w4a16:g128,w4a8")
    assert list(opts) == [DENSE, "w8a16", "w4a16:g128", "w4a8"]
    a = {"model.layers.0.mlp.down_proj": "w4a8", "model.layers.1.mlp.down_proj": "w4a16:g128",
         "model.layers.11.mlp.down_proj": "w4a16:g128", "model.layers.2.mlp.down_proj": DENSE}
    r = mix_recipe(a, opts)
    assert r.granularity == "g128" and r.skips("model.layers.2.mlp.down_proj")
    assert not r.skips("model.layers.12.mlp.down_proj")
    st = r.layer_settings("model.layers.0.mlp.down_proj", 704)
    assert st["act_bits"] == 8 and st["group"] is None and st["per_channel"]
    assert r.layer_settings("model.layers.11.mlp.down_proj", 704)["group"] == 64          # the g128 fallback
    assert QuantRecipe.from_dict(json.loads(json.dumps(r.to_dict()))) == r
    assert mix_recipe(dict.fromkeys(a, DENSE), opts) is None
    with pytest.raises(ConfigError, match="same method"):
        search_space("w8a16,w4a16:g128:gptq")
    assert parse_degradation("ppl", "2%") == 0.02 and parse_degradation("top1", "1.5") == 1.5
    for bad in ("-1", "x", "nan"):
        with pytest.raises(ConfigError):
            parse_degradation("kl", bad)


def test_layer_bytes_are_what_the_quantized_layers_hold():
    model = load_model(device="cpu").eval()
    targets = linear_targets(model)
    opts = search_space("w8a16,w4a16:g128")
    b = layer_bytes(model, targets, opts, backend="reference")
    q = quantize_model(load_model(device="cpu").eval(), "w4a16:g128")
    set_quant_backend(q, "reference")
    assert sum(b[(t, "w4a16:g128")] for t in targets) == weight_bytes(q)["quantized_linears"]
    assert b[(targets[0], DENSE)] == model.get_submodule(targets[0]).weight.numel() * 4


def test_calibrated_options_and_a_recipe_file_that_names_its_calibration_text(small, tmp_path):
    from workbench.quant.recipe import save_recipe

    model, ev = small
    ref = Reference(model, ev)
    tok = workbench.Tokenizer(workbench.BUNDLED_MODEL)
    cal, spec = jsonl_windows(calibration_set("reference"), tok, 64, 2, "calibration")
    targets = linear_targets(model)[:2]
    rows = layer_sensitivity(model, ref, search_space("w4a16:g128:gptq"), targets, calibration=cal)
    assert len(rows) == 2 and not any(isinstance(m, QuantLinear) for m in model.modules())
    recipe = mix_recipe({t: "w4a16:g128:gptq" for t in targets} | {t: DENSE for t in linear_targets(model)[2:]},
                        search_space("w4a16:g128:gptq"))
    path = save_recipe(tmp_path / "r.json", recipe, calibration=spec)
    llm = workbench.LLM(quant=str(path), quant_backend="reference")       # calibrates on the file's own windows
    direct = quantize_model(load_model(device="cpu").eval(), recipe, calibration=cal)
    for t in targets:
        assert torch.equal(llm.model.get_submodule(t).qweight, direct.get_submodule(t).qweight)


# ---- the recommendation rule on synthetic rows -----------------------------------------------

def _row(key, d, se, cost, samples=None):
    return {"key": key, "degradation": d, "degradation_se": se, "cost": cost, "samples": samples}


def test_recommend_confirms_the_pick_once_and_falls_back_beyond_noise():
    from workbench.quant.recommend import recommend

    rows = [_row("unquantized", 0.0, 0.0, 100), _row("cheap", 0.018, 0.004, 40),   # within 2 %, not beyond 2 se
            _row("safe", 0.005, 0.002, 60), _row("over", 0.03, 0.01, 30)]
    seen = []

    def confirm(r, fails=("cheap",)):
        seen.append(r["key"])
        return (0.025, 0.004) if r["key"] in fails else (0.006, 0.002)

    best, tries = recommend(rows, confirm, 0.02, "memory")
    assert best["key"] == "safe" and seen == ["cheap", "safe"] and [r["key"] for r in tries] == ["cheap", "safe"]
    assert best["confirmation_degradation"] == 0.006 and rows[1]["confirmed"] is False
    # a fallback that passes on the confirmation text only by its point estimate is not enough at
    # the second look: the next fallback (here the unquantized model) is taken
    seen.clear()
    best, tries = recommend([dict(r) for r in rows],
                            lambda r: (0.025, 0.004) if r["key"] == "cheap" else (0.019, 0.004), 0.02, "memory")
    assert best["key"] == "unquantized" and [r["key"] for r in tries] == ["cheap", "safe"]
    seen.clear()
    best, tries = recommend([dict(r) for r in rows], lambda r: confirm(r, fails=()), 0.02, "memory")
    assert best["key"] == "cheap" and seen == ["cheap"] and len(tries) == 1          # confirmed at once: one look
    best, _ = recommend([dict(r) for r in rows], lambda r: (0.5, 0.01), 0.02, "memory")
    assert best["key"] == "unquantized" and best["confirmed"]                          # nothing holds: unquantized


def test_recommend_latency_prefers_quality_when_speed_is_within_noise():
    from workbench.quant.recommend import recommend

    unq = _row("unquantized", 0.0, 0.0, 10.0, [10.0, 10.2, 9.9, 10.1, 10.0])
    close = _row("close", 0.01, 0.002, 9.9, [9.8, 10.1, 9.9, 10.0, 10.2])           # overlaps: within noise
    fast = _row("fast", 0.015, 0.002, 5.0, [5.0, 5.1, 4.9, 5.0, 5.2])               # beyond noise
    best, _ = recommend([unq, close], lambda r: (0.0, 0.0), 0.02, "latency", noise=0.05)
    assert best["key"] == "unquantized"              # the 1 % faster median is no measured speed-up
    best, _ = recommend([dict(unq), dict(close), fast], lambda r: (0.01, 0.002), 0.02, "latency", noise=0.05)
    assert best["key"] == "fast"
    # slower with overlapping ranges and a degradation within noise of the fastest's: the fastest stays
    slow = _row("slow", -0.0001, 0.0002, 23.0, [23.0, 22.0, 9.0, 24.0, 25.0])
    best, _ = recommend([dict(unq), slow], lambda r: (0.0, 0.0), 0.02, "latency", noise=0.05)
    assert best["key"] == "unquantized"


# ---- review fixes: units, stored bytes, names that match nothing, splits by document ----------

def test_fused_layers_are_one_unit_and_memory_counts_the_stored_format(run):
    _, res = run
    assert res["tie_fused"] and len(res["units"]) == 24 and {len(v) for v in res["units"].values()} == {1, 2, 3}
    for r in res["candidates"]:                           # q/k/v and gate/up of a block share one option
        a = r["assignment"]
        for u, layers in res["units"].items():
            assert len({a[l] for l in layers}) == 1, (r["key"], u)
    assert res["memory"] == "stored"
    for r in res["candidates"]:
        assert r["cost"] == r["stored_bytes"] and r["resident_bytes"] == r["stored_bytes"] + r["op_copy_bytes"]


def test_int4_cpu_op_copy_is_counted_only_when_resident_is_asked():
    model = load_model(device="cpu").eval()
    t = linear_targets(model)[:1]
    opts = search_space("w4a16:g128")
    stored = layer_bytes(model, t, opts, backend="cpu")[(t[0], "w4a16:g128")]
    resident = layer_bytes(model, t, opts, backend="cpu", op_copies=True)[(t[0], "w4a16:g128")]
    assert resident > stored == layer_bytes(model, t, opts, backend="reference")[(t[0], "w4a16:g128")]


def test_recipe_entries_that_name_no_layer_are_errors(tmp_path):
    from workbench.quant.recipe import save_recipe

    bad = QuantRecipe(weight_bits=4, skip=("embed_tokens", "lm_head", "model.layers.99.mlp.down_proj"))
    with pytest.raises(ConfigError, match="names 'model.layers.99.mlp.down_proj', which is no linear layer"):
        quantize_model(load_model(device="cpu").eval(), bad)
    with pytest.raises(ConfigError, match="overrides.*'layers.7.mlp.up_proj'"):
        quantize_model(load_model(device="cpu").eval(),
                       QuantRecipe(weight_bits=4, overrides=(("layers.7.mlp.up_proj", {"weight_bits": 8}),)))
    assert quantize_model(load_model(device="cpu").eval(), QuantRecipe(weight_bits=8, skip=("embed_tokens", "lm_head",
                                                                                            "mlp"))).recipe.skips(
        "model.layers.0.mlp.up_proj")                    # one component: wherever it occurs
    p = tmp_path / "r.json"
    save_recipe(p, QuantRecipe())
    doc = json.loads(p.read_text())
    for field, value, message in (("skip", 5, "'skip' must be a tuple"), ("weight_bits", 3, "must be 4 or 8"),
                                  ("overrides", [["down_proj", {"group": 3}]], "overrides' for 'down_proj'")):
        p.write_text(json.dumps({**doc, "recipe": {**doc["recipe"], field: value}}))
        with pytest.raises(ConfigError, match=message) as e:
            load_recipe(p)
        assert str(p) in str(e.value)


def test_rows_of_one_document_stay_in_one_part_and_windows_spread_over_the_part(bundled_tokenizer):
    from workbench.data import dataset_split, group_field_of, read_jsonl

    rows = read_jsonl(calibration_set("prose"))
    g = group_field_of(rows)
    assert g == "source"
    parts = {k: dataset_split(rows, k, 0.5, g) for k in ("calibration", "search", "confirmation")}
    docs = {k: {r["source"] for r in v} for k, v in parts.items()}
    assert not docs["calibration"] & docs["search"] and not docs["search"] & docs["confirmation"]
    assert not docs["calibration"] & docs["confirmation"]
    w, spec = jsonl_windows(calibration_set("prose"), bundled_tokenizer, 64, 4, "search")
    assert spec["group_field"] == "source" and spec["rows_used"] >= 3 and len(w) == 4   # not the first 4 windows
    first, _ = jsonl_windows(calibration_set("prose"), bundled_tokenizer, 64, 1000, "search")
    assert w[0] == first[0] and w[-1] != first[3]


def test_check_exits_1_when_the_figure_is_not_reproduced(run, tmp_path):
    out, _ = run
    doc = json.loads((out / "recipe.json").read_text())
    assert main(["calibrate-quant", "--check", str(out / "recipe.json"), "--json"]) == 0
    doc["reported"]["degradation"] += 0.01
    (tmp_path / "r.json").write_text(json.dumps(doc))
    assert main(["calibrate-quant", "--check", str(tmp_path / "r.json"), "--json"]) == 1
    (tmp_path / "r.json").write_text(json.dumps({k: v for k, v in doc.items() if k != "reported"}))
    assert main(["calibrate-quant", "--check", str(tmp_path / "r.json")]) == 2


def test_block_units_group_every_linear_of_a_decoder_block():
    from workbench.quant.sensitivity import layer_units

    targets = [f"model.layers.{i}.{k}" for i in (0, 1, 10) for k in
               ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")] + ["lm_head"]
    blocks = layer_units(targets, unit="block")
    assert list(blocks) == ["model.layers.0", "model.layers.1", "model.layers.10", "lm_head"]
    assert all(len(v) == 7 for k, v in blocks.items() if k != "lm_head")
    assert sum(map(len, blocks.values())) == len(targets)
    assert len(layer_units(targets)) == 3 * 4 + 1                  # q/k/v and gate/up tied
    with pytest.raises(ConfigError, match="unit must be one of layer, block"):
        layer_units(targets, unit="head")
