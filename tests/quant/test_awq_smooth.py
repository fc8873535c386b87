"""Folded per-channel scales (the float model's function unchanged), SmoothQuant and AWQ: what
must hold by construction is asserted; perplexities are printed (the benchmark measures them)."""

from __future__ import annotations

import math
import time

import pytest
import torch
from torch import nn

from workbench.bench.quant import perplexity
from workbench.errors import ConfigError
from workbench.model.config import ModelConfig
from workbench.model.decoder import CausalLM, init_weights
from workbench.quant.apply import QuantLinear, quantize_model
from workbench.quant.awq import awq_scales, awq_search, group_loss, search_scale
from workbench.quant.calib import collect_linear_inputs
from workbench.quant.fold import fold_scales, scale_groups, skipped_groups
from workbench.quant.recipe import QuantRecipe
from workbench.quant.rtn import quantize_weight
from workbench.quant.smooth import outlier_ratio, smooth_model


def _tiny(gqa: bool, seed: int = 0) -> CausalLM:
    """A random 2-layer model with biases and non-trivial norm weights (folding must handle both)."""
    cfg = ModelConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2 if gqa else 4, max_position_embeddings=128,
                      tie_word_embeddings=True, qkv_bias=True, o_bias=True, mlp_bias=True)
    model = init_weights(CausalLM(cfg), seed=seed).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif name.endswith(".bias"):
                p.copy_(0.02 * torch.randn(p.shape, generator=gen))
    return model


def _random_scales(model, seed=0):
    gen = torch.Generator().manual_seed(seed)
    for g in scale_groups(model):
        n = model.get_submodule(g.layers[0]).in_features
        fold_scales(model, g, torch.exp(torch.randn(n, generator=gen)))      # s in ~[0.05, 20]


@pytest.fixture(scope="module")
def split(bundled_llm):
    from workbench.bench.tier_eval import heldout_split

    sp = heldout_split(bundled_llm.tokenizer, 256)
    return {"calibration": sp["calibration"][:4], "evaluation": sp["evaluation"][:2]}


@pytest.fixture(scope="module")
def fp32_ppl(bundled_llm, split):
    return perplexity(bundled_llm.model, split["evaluation"])


# ---------------------------------------------------------------------------------------- folding

@pytest.mark.parametrize("gqa", [False, True], ids=["mha", "gqa"])
def test_folding_random_scales_keeps_the_tiny_models_function(gqa):
    model = _tiny(gqa)
    groups = scale_groups(model)
    kinds = [g.kind for g in groups if g.layer == 0]
    assert kinds == (["attn_in", "mlp_in", "mlp_down"] if gqa else ["attn_in", "attn_out", "mlp_in", "mlp_down"])
    assert len(skipped_groups(model)) == (2 if gqa else 0)
    if gqa:
        assert "grouped-query" in skipped_groups(model)[0]["skipped"]
    ids = torch.randint(0, 97, (2, 40), generator=torch.Generator().manual_seed(0))
    emb, fnorm = model.model.embed_tokens.weight.clone(), model.model.norm.weight.clone()
    with torch.no_grad():
        ref = model(ids)
        _random_scales(model)
        out = model(ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(model.model.embed_tokens.weight, emb) and torch.equal(model.model.norm.weight, fnorm)
    assert model.lm_head.weight is model.model.embed_tokens.weight             # tied, untouched


def test_folding_random_scales_keeps_the_bundled_models_function(bundled_llm, split):
    import workbench as wb

    model = wb.load_model().eval()
    ids = torch.tensor(split["calibration"][0][:128])[None]
    with torch.no_grad():
        ref = model(ids)
        _random_scales(model, seed=1)
        out = model(ids)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))


def test_fold_refuses_what_it_cannot_fold():
    model = _tiny(gqa=True)
    g = scale_groups(model)[0]
    with pytest.raises(ConfigError, match="positive"):
        fold_scales(model, g, -torch.ones(64))
    with pytest.raises(ConfigError, match="64 channels"):
        fold_scales(model, g, torch.ones(63))
    with pytest.raises(ConfigError, match="Llama-family"):
        scale_groups(nn.Sequential(nn.Linear(4, 4)))
    quantize_model(model, "w8a16")
    with pytest.raises(ConfigError, match="QuantLinear"):
        fold_scales(model, g, torch.ones(64))


# ------------------------------------------------------------------------------------ SmoothQuant

def test_smoothquant_moves_the_outlier_range_and_keeps_the_function(bundled_llm, split):
    import workbench as wb

    cal = split["calibration"]
    model = wb.load_model().eval()
    ids = torch.tensor(cal[0][:128])[None]
    with torch.no_grad():
        ref = model(ids)
    rows = smooth_model(model, collect_linear_inputs(model, cal), 0.5)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()))
    after = collect_linear_inputs(model, cal)                        # measured on the smoothed model
    done = [r for r in rows if "skipped" not in r]
    assert len(done) == 18 and sum("skipped" in r for r in rows) == 6  # GQA: v -> o left out, said so
    for r in done:
        measured = after[r["layers"][0]].absmax
        assert outlier_ratio(measured) == pytest.approx(r["outlier_ratio_after"], rel=1e-3)
        assert float(measured.max()) == pytest.approx(r["absmax_after"], rel=1e-3)
    worst = max(done, key=lambda r: r["outlier_ratio_before"])
    assert worst["outlier_ratio_after"] < worst["outlier_ratio_before"]
    ratios = torch.tensor([[r["outlier_ratio_before"], r["outlier_ratio_after"]] for r in done])
    assert float(ratios[:, 1].median()) < float(ratios[:, 0].median())
    print(f"\nSmoothQuant alpha 0.5, max/median of per-channel max|X| (median over {len(done)} groups): "
          f"{float(ratios[:, 0].median()):.2f} -> {float(ratios[:, 1].median()):.2f}; "
          f"worst group {worst['layers'][0]}: "
          f"{worst['outlier_ratio_before']:.2f} -> {worst['outlier_ratio_after']:.2f}")


def test_w8a8_with_and_without_smoothing(bundled_llm, split, fp32_ppl):
    import workbench as wb

    ppl = {}
    for spec in ("w8a8", "w8a8:smooth=0.5"):
        model = wb.load_model().eval()
        quantize_model(model, spec, calibration=split["calibration"])
        with torch.no_grad():
            assert torch.isfinite(model(torch.tensor(split["evaluation"][0][:64])[None])).all()
        ppl[spec] = perplexity(model, split["evaluation"])
        assert math.isfinite(ppl[spec]) and ppl[spec] < 1.5 * fp32_ppl
    assert model.recipe.name == "w8a8-per-channel-sym-rtn-smooth=0.5"
    assert len(model.quant_calibration["smooth"]) == 24
    print(f"\nppl on {len(split['evaluation'])} evaluation windows of 256 tokens: fp32 {fp32_ppl:.3f}, "
          f"W8A8 {ppl['w8a8']:.3f}, W8A8 + SmoothQuant(0.5) {ppl['w8a8:smooth=0.5']:.3f}")


def test_smooth_config_errors(bundled_llm, split):
    import workbench as wb

    model = wb.load_model().eval()
    stats = collect_linear_inputs(model, split["calibration"][:1])
    del stats["model.layers.2.mlp.down_proj"]
    w0 = model.model.layers[0].input_layernorm.weight.clone()
    with pytest.raises(ConfigError, match=r"model\.layers\.2\.mlp\.down_proj"):
        smooth_model(model, stats, 0.5)
    assert torch.equal(model.model.layers[0].input_layernorm.weight, w0)   # checked before anything is folded
    with pytest.raises(ConfigError, match="alpha"):
        smooth_model(model, stats, 1.5)
    with pytest.raises(ConfigError, match="smooth"):
        QuantRecipe.parse("w8a8:smooth=2")
    with pytest.raises(ConfigError, match="calibration"):
        quantize_model(model, "w8a8:smooth=0.5")


# -------------------------------------------------------------------------------------------- AWQ

def test_awq_end_to_end_on_the_bundled_model(bundled_llm, split, fp32_ppl):
    import workbench as wb

    rtn = wb.load_model().eval()
    quantize_model(rtn, "w4a16:g128")
    model = wb.load_model().eval()
    t = time.perf_counter()
    quantize_model(model, "w4a16:g128:awq", calibration=split["calibration"])
    seconds = time.perf_counter() - t
    rows = model.quant_calibration["awq"]
    groups = [r for r in rows if "alpha" in r]
    assert len(groups) == 18                                                 # 3 foldable groups x 6 layers
    for r in groups:
        assert r["loss"] <= r["loss_rtn"] and r["losses"][0] == r["loss_rtn"] and 0 <= r["alpha"] < 1
    clips = [c for r in rows for c in r.get("clip", {}).values() if c["searched"]]
    assert len(clips) == 30                                                  # 7 - 2 per layer (q, k: none)
    assert all(c["loss_after"] <= c["loss_before"] for c in clips)
    ppl_awq, ppl_rtn = perplexity(model, split["evaluation"]), perplexity(rtn, split["evaluation"])
    assert math.isfinite(ppl_awq) and ppl_awq < 1.2 * fp32_ppl
    print(f"\nppl on {len(split['evaluation'])} evaluation windows of 256 tokens: fp32 {fp32_ppl:.3f}, "
          f"RTN w4a16:g128 {ppl_rtn:.3f}, AWQ w4a16:g128 {ppl_awq:.3f} (AWQ search {seconds:.1f} s on "
          f"{len(split['calibration'])} x 256 calibration tokens); alphas "
          f"{[r['alpha'] for r in groups]}, mean group loss vs RTN "
          f"{sum(r['loss'] / r['loss_rtn'] for r in groups) / len(groups):.3f}")


def test_awq_clip_multipliers_feed_quantize_weight():
    model = _tiny(gqa=False)
    seqs = torch.randint(0, 97, (3, 48), generator=torch.Generator().manual_seed(1)).tolist()
    recipe = QuantRecipe.parse("w4a16:g32:awq")
    with torch.no_grad():
        ref = model(torch.tensor(seqs[:1]))
    res = awq_search(model, recipe, seqs, rows=128)
    with torch.no_grad():                                    # scales folded: the float model is unchanged
        torch.testing.assert_close(model(torch.tensor(seqs[:1])), ref, rtol=1e-4, atol=1e-5)
    assert res.clip and all(n.split(".")[-1] not in ("q_proj", "k_proj") for n in res.clip)
    for name, c in res.clip.items():
        lin = model.get_submodule(name)
        assert c.shape == (lin.out_features, lin.in_features // 32)
        assert bool((c > 0).all()) and bool((c <= 1).all())
    assert {r["kind"] for r in res.report if "alpha" in r} == {"attn_in", "attn_out", "mlp_in", "mlp_down"}
    quantize_model(model, recipe, calibration=seqs)          # the whole path, on a model without GQA
    assert isinstance(model.model.layers[0].self_attn.o_proj, QuantLinear)


def test_awq_beats_rtn_on_a_layer_with_large_activation_channels():
    """Synthetic: one linear whose input has a few large channels.  RTN (alpha = 0) spends each
    group's grid on the weights alone; AWQ scales the salient columns up and their error down."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=gen)
    x[:, [3, 40, 77, 100]] *= 30.0
    w = torch.randn(96, 128, generator=gen) * 0.05
    st = QuantRecipe.parse("w4a16:g32").layer_settings("layer", 128)
    alpha, s, loss, losses = search_scale(x, x.abs().mean(0), [w], [st])
    assert alpha > 0 and loss < 0.7 * losses[0]
    assert losses[0] == pytest.approx(group_loss(x, [w], [st], torch.ones(128)))
    ref = x @ w.T                                     # the same, as the folded, quantized layer's output error
    rtn_err = float((x @ quantize_weight(w, bits=4, group=32).dequantize().T - ref).pow(2).mean())
    awq_err = float(((x / s) @ quantize_weight(w * s, bits=4, group=32).dequantize().T - ref).pow(2).mean())
    assert awq_err < 0.7 * rtn_err and awq_err == pytest.approx(loss, rel=1e-3)
    print(f"\nsynthetic layer, 4 input channels x30: output MSE RTN {rtn_err:.3e}, AWQ {awq_err:.3e} (alpha {alpha})")
    assert torch.equal(awq_scales(x.abs().mean(0), 0.0), torch.ones(128))


def _outputs(model, names, ids) -> dict:
    """The outputs of the modules ``names`` on one forward of ``ids``."""
    got: dict = {}
    hooks = [model.get_submodule(n).register_forward_hook(lambda _m, _a, o, n=n: got.__setitem__(n, o))
             for n in names]
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return got


def test_awq_helps_a_model_with_outlier_channels():
    """A tiny random model whose first input norm amplifies four channels 40x: AWQ picks a scale
    there and the quantized q/k/v outputs (the real QuantLinear modules) are closer to fp32."""
    seqs = torch.randint(0, 97, (4, 48), generator=torch.Generator().manual_seed(2)).tolist()
    names = [f"model.layers.0.self_attn.{k}_proj" for k in "qkv"]
    err = {}
    for spec in ("w4a16:g32", "w4a16:g32:awq"):
        model = _tiny(gqa=True, seed=5)
        with torch.no_grad():
            model.model.layers[0].input_layernorm.weight[[1, 17, 33, 60]] *= 40.0
        ref = _outputs(model, names, torch.tensor(seqs))
        quantize_model(model, spec, calibration=seqs)
        got = _outputs(model, names, torch.tensor(seqs))
        err[spec] = sum(float((got[n] - ref[n]).pow(2).mean()) for n in names)
    row = next(r for r in model.quant_calibration["awq"] if r["kind"] == "attn_in" and r["layer"] == 0)
    assert row["alpha"] > 0 and row["loss"] < row["loss_rtn"]
    assert err["w4a16:g32:awq"] < err["w4a16:g32"]
    print(f"\nq/k/v output MSE with 4 outlier channels: RTN {err['w4a16:g32']:.3e}, AWQ {err['w4a16:g32:awq']:.3e}")


def test_awq_config_errors():
    model = _tiny(gqa=True)
    with pytest.raises(ConfigError, match="calibration"):
        quantize_model(model, "w4a16:g32:awq")
    with pytest.raises(ConfigError, match="calibration"):
        awq_search(model, "w4a16:g32:awq", [])
    with pytest.raises(ConfigError, match="Llama-family"):
        awq_search(nn.Sequential(nn.Linear(4, 4)), "w4a16:awq", [[1, 2]])
