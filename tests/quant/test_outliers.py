"""Outlier statistics: planted outlier channels are found and their range share is right; what
granularity and int8 activations do to the output error; weight maps of quantized layers; the
activation maps of the bundled model (its measured outlier ratios are printed)."""

from __future__ import annotations

import math

import pytest
import torch

from workbench.errors import ConfigError
from workbench.model.config import ModelConfig
from workbench.model.decoder import CausalLM, init_weights
from workbench.quant.apply import QuantLinear, quantize_model
from workbench.quant.calib import LinearInputs, collect_linear_inputs
from workbench.quant.outliers import (KINDS, activation_map, compare_stats, range_setters, recurring_channels,
                                      scheme_errors, weight_map)
from workbench.quant.rtn import quantize_weight

PLANTED = (5, 17, 40)
GAINS = (20.0, 25.0, 30.0)


def _stats_from_rows(rows_by_name: dict) -> dict:
    out = {}
    for n, x in rows_by_name.items():
        a = x.abs()
        out[n] = LinearInputs(x.shape[0], a.amax(0), a.mean(0), None, x)
    return out


@pytest.fixture(scope="module")
def planted():
    """Four 'down_proj' layers, 512 tokens x 64 channels of N(0, 1), channels 5 / 17 / 40 scaled
    by 20 / 25 / 30 in every layer (as the residual stream's outlier dimensions recur)."""
    g = torch.Generator().manual_seed(0)
    rows = {}
    for i in range(4):
        x = torch.randn(512, 64, generator=g)
        for c, k in zip(PLANTED, GAINS):
            x[:, c] *= k
        rows[f"model.layers.{i}.mlp.down_proj"] = x
    return rows, _stats_from_rows(rows)


def test_range_setters_find_the_planted_channels(planted):
    rows, stats = planted
    res = range_setters(stats, top=3)
    assert [r["layer"] for r in res] == list(stats) and all(r["kind"] == "down_proj" for r in res)
    for r in res:
        x = rows[r["layer"]]
        a = x.abs().amax(0).double()
        assert sorted(r["top_channels"]) == list(PLANTED)
        assert r["top_absmax"] == sorted(r["top_absmax"], reverse=True)
        assert r["max_median"] == pytest.approx(float(a.max() / a.median()), rel=1e-6)
        assert r["max_median"] > 15                         # N(0,1) over 512 tokens: max ~3.3; x30 -> ~100
        rest = [j for j in range(64) if j not in PLANTED]
        assert r["range_share"] == pytest.approx(float(a.max() / a[rest].max()), rel=1e-6)
        assert r["range_share"] > 15
        top_of_token = x.abs().argmax(1)                    # nearly every token's largest |x| is a planted one
        assert r["token_top_fraction"] == pytest.approx(sum(int(c) in PLANTED for c in top_of_token) / 512)
        assert r["token_top_fraction"] > 0.98
        assert r["token_range_share"] > 10
        assert r["recurring"] == 3 and r["layers_of_kind"] == 4
    rec = recurring_channels(stats, "down_proj", top=3)
    assert rec == [(5, 4), (17, 4), (40, 4)]
    # two of the three: the third planted channel still sets the range (x20 against x30); one more than
    # planted: the 4th is noise and barely moves it
    assert range_setters(stats, top=2)[0]["range_share"] < 2
    assert range_setters(stats, top=4)[0]["range_share"] / res[0]["range_share"] < 1.2


def test_activation_map_and_compare_stats_on_a_smoothing_like_transform(planted):
    _, stats = planted
    labels, m = activation_map(stats, "down_proj")
    assert labels == ["L0", "L1", "L2", "L3"] and m.shape == (4, 64)
    assert torch.equal(m[2], stats["model.layers.2.mlp.down_proj"].absmax)
    with pytest.raises(ConfigError, match="no linear layer of kind"):
        activation_map(stats, "q_proj")
    # x / s with s_j = sqrt(max|x_j|) (SmoothQuant at alpha = 0.5 against flat weights): the per-channel
    # maxima become sqrt(max|x_j|), so max/median becomes the square root of what it was
    after = {n: LinearInputs(s.count, s.absmax / s.absmax.sqrt(), s.absmean, None, None) for n, s in stats.items()}
    rows = compare_stats(stats, after, "down_proj")
    assert len(rows) == 4
    for r in rows:
        assert r["max_median_after"] == pytest.approx(math.sqrt(r["max_median_before"]), rel=1e-5)
        assert r["absmax_after"] == pytest.approx(math.sqrt(r["absmax_before"]), rel=1e-5)
        assert r["top_channel_before"] == r["top_channel_after"] and r["top_channel_after"] in PLANTED


def test_scheme_errors_granularity_and_the_split():
    g = torch.Generator().manual_seed(1)
    # rows (output channels) of very different scales: one per-tensor scale wastes the grid on the small rows
    w = torch.randn(64, 128, generator=g) * torch.logspace(-2, 1, 64)[:, None]
    x = torch.randn(256, 128, generator=g)
    err = {r["scheme"]: r for r in scheme_errors(w, x)}
    assert err["W4 per-channel"]["rel_error"] <= err["W4 per-tensor"]["rel_error"]
    assert err["W4 per-tensor"]["granularity"] == "per-tensor" and err["W4 g32"]["granularity"] == "g32"
    # groups inside a row: columns of different scales (seeded case where g32 beats per-channel)
    w2 = torch.randn(64, 128, generator=g) * torch.linspace(0.05, 4, 128)
    e2 = {r["scheme"]: r for r in scheme_errors(w2, x)}
    assert e2["W4 g32"]["rel_error"] <= e2["W4 g64"]["rel_error"] <= e2["W4 per-channel"]["rel_error"]
    for r in e2.values():                                   # E = E_O + E_R: the parts bound the whole
        assert r["rel_error"] <= r["outlier_error"] + r["rest_error"] + 1e-12
        assert 0 <= r["outlier_share"] <= 1
    # no outlier channel singled out: everything is the rest; identity scheme: no error
    none = scheme_errors(w2, x, [("W4 g32", "w4a16:g32"), ("exact", lambda t: t)], outliers=[])
    assert none[0]["outlier_error"] == 0 and none[0]["rest_error"] == pytest.approx(none[0]["rel_error"])
    assert none[1]["rel_error"] == pytest.approx(0, abs=1e-7)
    with pytest.raises(ConfigError, match="same in"):
        scheme_errors(w, x[:, :64])


def test_per_token_int8_activations_spoil_the_other_channels(planted):
    """Outlier channels set the per-token int8 scale: W8A8's extra error over W8 lands on the
    other channels."""
    rows, _ = planted
    x = rows["model.layers.0.mlp.down_proj"][:256]
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
    err = {r["scheme"]: r for r in scheme_errors(w, x, ["w8a16:pc", "w8a8:pc"], top=3)}
    w8, w8a8 = err["w8a16:pc"], err["w8a8:pc"]
    assert w8a8["outlier_channels"] == sorted(PLANTED)
    assert w8a8["rel_error"] > 2 * w8["rel_error"]
    assert w8a8["rest_error"] > 2 * w8["rest_error"] and w8a8["outlier_share"] < w8["outlier_share"]


def test_weight_map_of_linear_and_quantlinear():
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    m = init_weights(CausalLM(cfg), seed=0).eval()
    labels, dense = weight_map(m, "down_proj")
    assert labels == ["L0", "L1"] and dense.shape == (2, 96)
    assert torch.equal(dense[1], m.model.layers[1].mlp.down_proj.weight.abs().amax(0))
    w0 = m.model.layers[0].mlp.down_proj.weight.detach().clone()
    quantize_model(m, "w4a16:g32")
    mod = m.model.layers[0].mlp.down_proj
    assert isinstance(mod, QuantLinear)
    labels, q = weight_map(m, "down_proj")
    assert torch.equal(q[0], mod.quantized.dequantize(torch.float32).abs().amax(0))
    assert torch.equal(q[0], quantize_weight(w0, bits=4, group=32).dequantize(torch.float32).abs().amax(0))
    assert not torch.equal(q[0], dense[0])


def test_bundled_model_activation_maps(bundled_llm):
    """Shapes of the maps on the bundled model (2 calibration windows of 128 tokens), and the
    measured outlier ratios, printed."""
    from workbench.data import heldout_split

    cfg = bundled_llm.model.config
    calib = [s[:128] for s in heldout_split(bundled_llm.tokenizer, 256)["calibration"][:2]]
    stats = collect_linear_inputs(bundled_llm.model, calib, keep_rows=128)
    width = {"q_proj": cfg.hidden_size, "o_proj": cfg.num_attention_heads * cfg.head_dim,
             "gate_proj": cfg.hidden_size, "down_proj": cfg.intermediate_size}
    for kind in KINDS:
        labels, m = activation_map(stats, kind)
        assert labels == [f"L{i}" for i in range(cfg.num_hidden_layers)]
        assert m.shape == (cfg.num_hidden_layers, width[kind]) and bool((m > 0).all())
        _, wm = weight_map(bundled_llm.model, kind)
        assert wm.shape == m.shape
        rows = range_setters(stats, top=8, kinds=[kind])
        assert all(r["max_median"] >= 1 and r["range_share"] >= 1 for r in rows)
        print(f"{kind:9s} max/median per layer: " + " ".join(f"{r['max_median']:.2f}" for r in rows)
              + "; range share of the top 8: " + " ".join(f"{r['range_share']:.2f}" for r in rows)
              + f"; recurring (channel, layers): {recurring_channels(stats, kind, 8)[:4]}")
