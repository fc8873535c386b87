"""The physical tiered cache's bench on short windows of the bundled model: real decode steps
equal the accounted cache bit for bit, measured bytes equal the formula, the routing counters
are consistent, the long-context projection's arithmetic checks by hand, and the CLI."""

from __future__ import annotations

import json
import math

import pytest

from workbench.bench.tier_eval import heldout_split, reference_logits
from workbench.bench.tier_physical import CONFIGS, named_config, physical_eval, predictor_comparison
from workbench.bench.tier_projection import claim_8k_64k, long_context_projection
from workbench.cli.main import main
from workbench.cli.tiers import format_tier_bench
from workbench.errors import ConfigError
from workbench.kv.pca import fit_pca_from_model
from workbench.kv.tier_config import zone_counts

CONTEXT, E = 192, 16
CFG = CONFIGS["default"]
VALID = ("holds", "does not hold", "cannot be tested here")


@pytest.fixture(scope="module")
def setup(bundled_llm):
    split = heldout_split(bundled_llm.tokenizer, context=CONTEXT)
    model = bundled_llm.model.eval()
    basis = fit_pca_from_model(model, split["calibration"][:1], key_space="pre_rope")
    seqs = split["evaluation"][:1]
    return model, basis, seqs, reference_logits(model, seqs)


@pytest.fixture(scope="module")
def row(setup):
    model, basis, seqs, ref = setup
    return physical_eval(model, CFG, basis, seqs, eval_tokens=E, reference=ref)


def test_physical_eval_equals_accounted_and_formula(setup, row):
    model, _, seqs, ref = setup
    assert row["kind"] == "measurement" and row["scored_tokens"] == row["decode_steps"] == E
    assert row["max_abs_diff_vs_accounted"] == 0.0 and row["greedy_identical"] is True
    assert abs(row["measured_vs_formula"] - 1) <= 0.05 and row["measured_vs_formula_max_dev"] <= 0.05
    assert row["measured_bytes_per_token"] == row["formula_bytes_per_token"]          # exactly, in fact
    assert row["reduction_measured"] > 1
    assert row["full_bytes_per_token"] == 2 * 6 * 4 * 32 * 4                          # fp32 K+V, 6 layers x 4 heads
    assert row["reduction_with_staging"] <= row["reduction_measured"]
    # the routing the physical cache needed equals the accounted cache's figure on the same calls
    assert row["routed_bytes_per_step"] > 0
    assert row["routed_bytes_per_step"] == pytest.approx(row["routed_bytes_per_step_accounted"])
    # ppl_full from the same reference logits the test computes
    seq, N = seqs[0], len(seqs[0])
    import torch
    lp = torch.log_softmax(ref[0][N - E - 1:N - 1], -1)
    nll = -lp.gather(1, torch.tensor(seq[N - E:])[:, None]).mean()
    assert row["ppl_full"] == pytest.approx(math.exp(float(nll)), rel=1e-5)
    assert 0 <= row["top1"] <= 1 and row["kl"] >= 0
    # predict="step": no copies ahead of use, kept staging counts as reuse; every use is a hit or a demand fetch
    assert row["predicted"] == 0 and row["hits"] == row["reused"] > 0 and row["demand"] > 0
    assert row["uses"] - row["hits"] <= row["demand"]
    parts = row["components"]["parts"]
    assert parts["hot_kv"]["elements"] == 2 * 32 and parts["cold_kv"]["elements"] == 2 * 32
    assert parts["warm_coef"]["elements"] == CFG.rank and parts["warm_v"]["elements"] == 32


def test_predictors_same_quality_different_traffic(setup, row):
    model, basis, seqs, ref = setup
    pc = predictor_comparison(model, CFG, basis, seqs, E, ref, known={("host", "step"): row})
    by = {(r["offload"], r["predict"]): r for r in pc["rows"]}
    assert set(by) == {("host", p) for p in ("none", "step", "layer", "both")} | {("disk", "step")}
    assert pc["same_quality"]
    none, step = by[("host", "none")], by[("host", "step")]
    assert none["error"] is None and none["prefetch_hit_rate"] == 0 and none["staging_bytes_max"] == 0
    assert none["reused"] == 0 and none["bytes_moved_per_step"] >= none["routed_bytes_per_step"]
    assert step["bytes_moved_per_step"] < none["bytes_moved_per_step"] and step["staging_bytes_mean"] > 0
    assert by[("host", "layer")]["predicted"] > 0
    disk = by[("disk", "step")]
    assert disk["error"] is None or "Error" in disk["error"]
    if disk["error"] is None:
        assert disk["bytes_moved_per_step"] == step["bytes_moved_per_step"] and disk["stall_ms_per_step"] > 0


def test_int8_values_measured_equal_formula(setup):
    model, basis, seqs, ref = setup
    cfg = CONFIGS["int8"]
    r = physical_eval(model, cfg, basis, seqs, eval_tokens=8, reference=ref)
    assert r["max_abs_diff_vs_accounted"] == 0.0 and r["greedy_identical"]
    assert r["measured_vs_formula"] == 1.0
    p = r["components"]["parts"]
    assert (p["warm_vq"]["element_size"], p["warm_vq"]["elements"]) == (1, 32)
    assert (p["warm_vs"]["element_size"], p["warm_vs"]["elements"]) == (2, 1)
    proj = long_context_projection(r, cfg, presets=("llama-2-7b",), lengths=(8192,))
    z = zone_counts(8192, cfg)
    assert proj["rows"][0]["warm_bytes"] == z.warm * 32 * 32 * (cfg.rank * 2 + 128 + 2)
    assert proj["rows"][0]["matches_formula"]
    with pytest.raises(ConfigError, match="value_format"):
        long_context_projection(r, CFG)


def test_projection_arithmetic_by_hand(row):
    proj = long_context_projection(row, CFG)
    assert proj["kind"] == "projection" and "not a measurement" in proj["caption"]
    assert all(r["kind"] == "projection" for r in proj["rows"] + proj["basis"])
    assert {(r["preset"], r["length"]) for r in proj["rows"]} == {
        (p, n) for p in ("llama-3.2-1b", "llama-3-8b", "llama-2-7b") for n in (8192, 32768, 65536)}
    r = next(r for r in proj["rows"] if r["preset"] == "llama-2-7b" and r["length"] == 8192)
    L, nkv, hd, eb = 32, 32, 128, 2
    z = zone_counts(8192, CFG)
    assert r["full_bytes"] == 8192 * 2 * 32 * 32 * 128 * 2 == 4 * 2**30
    assert r["hot_bytes"] == z.hot * L * nkv * 2 * hd * eb
    assert r["warm_bytes"] == z.warm * L * nkv * (CFG.rank + hd) * eb
    assert r["cold_bytes"] == z.cold_chunks * L * nkv * 2 * hd * eb
    assert r["basis_bytes"] == L * nkv * (hd + hd * CFG.rank) * eb
    assert r["tiered_bytes"] == r["hot_bytes"] + r["warm_bytes"] + r["cold_bytes"] + r["basis_bytes"]
    assert r["reduction"] == pytest.approx(r["full_bytes"] / r["tiered_bytes"])
    assert all(x["matches_formula"] for x in proj["rows"])
    b = next(b for b in proj["basis"] if b["preset"] == "llama-3.2-1b")
    assert (b["mean_elements"], b["component_elements"]) == (64, 64 * CFG.rank)
    # a different rank: coefficients scale with it, K/V rows do not
    r16 = long_context_projection(row, CFG.replace(rank=16), presets=("llama-2-7b",), lengths=(8192,))["rows"][0]
    assert r16["warm_bytes"] - r["warm_bytes"] == z.warm * L * nkv * 8 * eb and r16["hot_bytes"] == r["hot_bytes"]


def test_claim_verdict(row):
    proj = long_context_projection(row, CFG)
    v = claim_8k_64k(proj, measured=row)
    assert v["verdict"] in VALID and v["accuracy"]["verdict"] == "cannot be tested here"
    per_token = 2 * 32 * 32 * 128 * 2
    assert v["numbers"]["full_8k_gb"] == round(8192 * per_token / 1e9, 3)
    assert v["numbers"]["cold_floor_64k_gb"] == round(65536 // 16 * per_token / 1e9, 3)
    assert v["memory_literal"] == "does not hold"      # 4.3 GB at 8K; 8 such sequences need >= 16 GiB at 64K
    assert v["memory_64k"] == "holds" and v["verdict"] == "cannot be tested here"
    assert v["numbers"]["tiered_64k_gb"] >= v["numbers"]["cold_floor_64k_gb"]
    # a tiered figure above 11 GB at 64K breaks the only reading that held
    bad = {**proj, "rows": [dict(r, tiered_bytes=20 * 10**9) for r in proj["rows"]]}
    assert claim_8k_64k(bad)["verdict"] == "does not hold"


def test_named_configs():
    assert named_config("default") == CFG and named_config("no-routing").budget is None
    assert named_config("window=64,budget=None") == CFG.replace(window=64, budget=None)
    for bad in ("bogus", "nosuchfield=3", "window=x"):
        with pytest.raises(ConfigError):
            named_config(bad)


def test_cli_json_tiny(bundled_llm, capsys):
    rc = main(["tier-bench", "--json", "--docs", "1", "--eval-tokens", "8", "--context", str(CONTEXT),
               "--calibration-docs", "1", "--config", "default", "--no-compare"])
    assert rc == 0
    res = json.loads(capsys.readouterr().out)
    (r,) = res["rows"]
    assert r["greedy_identical"] is True and r["max_abs_diff_vs_accounted"] == 0.0
    assert r["measured_vs_formula"] == 1.0 and r["scored_tokens"] == 8 and res["predictors"] is None
    assert all(x["kind"] == "projection" for x in res["projection"]["rows"])
    assert res["claim"]["verdict"] in VALID
    text = format_tier_bench(res)
    assert "PROJECTION, not a measurement" in text and "verdict: " in text and r["config"] in text


def test_cli_rejects_bad_options(capsys):
    assert main(["tier-bench", "--config", "bogus"]) == 2
    err = capsys.readouterr().err
    assert "unknown tier config 'bogus'" in err and "Traceback" not in err
    assert main(["tier-bench", "--docs", "0"]) == 2
    assert "--docs" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["tier-bench", "--offload", "tape"])
    assert e.value.code == 2
