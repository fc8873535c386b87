"""Your functions in the int4 quantizer (workbench.quant.hooks): quantize_model(..., group_scales=, pack=)
gives the package's model bit for bit when they agree with the package, and a bad return value is one
WorkbenchError naming the rule and the layer, with the model left as it was."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from workbench.errors import ConfigError, WorkbenchError
from workbench.model.config import ModelConfig
from workbench.model.decoder import CausalLM, init_weights
from workbench.quant.apply import QuantLinear, quantize_model
from workbench.quant.rtn import compute_scales, pack_int4, quantize_weight


def _model() -> CausalLM:
    # MLP width 96: a g64 recipe falls back to g32 for down_proj (the pow2 rule), per-channel with fallback=per-channel
    cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True, eos_token_id=0)
    return init_weights(CausalLM(cfg), seed=5).eval()


def scales_like_package(w, group):
    s, z = compute_scales(w, bits=4, group=group, symmetric=False)
    return s, z.to(torch.int8)


def pack_like_package(codes):
    return pack_int4(codes)


def _buffers(model) -> dict:
    return {f"{n}.{b}": t for n, m in model.named_modules() if isinstance(m, QuantLinear)
            for b, t in (("qweight", m.qweight), ("scales", m.scales), ("zeros", m.zeros)) if t is not None}


def _untouched(model) -> bool:
    return getattr(model, "recipe", None) is None and not any(isinstance(m, QuantLinear) for m in model.modules())


@pytest.mark.parametrize("spec", ["w4a16:g64:asym", "w4a16:g64:asym:fallback=per-channel", "w4a16:pc:asym"])
def test_hooks_that_agree_give_the_packages_model_bit_for_bit(spec):
    seen = []

    def scales(w, group):
        seen.append((tuple(w.shape), group, w.dtype))
        return scales_like_package(w, group)

    ref = quantize_model(_model(), spec)
    mine = quantize_model(_model(), spec, group_scales=scales, pack=pack_like_package)
    a, b = _buffers(ref), _buffers(mine)
    assert a.keys() == b.keys() and len(a) == 3 * 14
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    ids = torch.arange(12)[None]
    assert torch.equal(ref(ids), mine(ids))
    assert all(dt == torch.float32 for _, _, dt in seen)
    down = [(shape, g) for shape, g, _ in seen if shape[1] == 96]
    want = 96 if ("per-channel" in spec or ":pc" in spec) else 32     # one scale per row: the group is the width
    assert down and all(g == want for _, g in down)


def test_pack_alone_works_for_symmetric_int4_too():
    w = torch.randn(8, 32)
    a = quantize_weight(w, bits=4, group=16)
    b = quantize_weight(w, bits=4, group=16, pack=pack_like_package)
    assert torch.equal(a.qweight, b.qweight) and torch.equal(a.scales, b.scales)


def _zero_scale(w, g):
    s, z = scales_like_package(w, g)
    s[1, 0] = 0.0
    return s, z


def _zero_point_16(w, g):
    s, z = scales_like_package(w, g)
    z[0, 0] = 16
    return s, z


def _swapped(codes):
    c = codes.to(torch.uint8)
    return (c[:, 0::2] << 4) | c[:, 1::2]


@pytest.mark.parametrize("kw, words", [
    (dict(group_scales=lambda w, g: scales_like_package(w, g)[0]), ["a pair (scales, zeros)"]),
    (dict(group_scales=lambda w, g: (scales_like_package(w, g)[0], scales_like_package(w, g)[1].float())),
     ["zeros must be int8", "got float32"]),
    (dict(group_scales=lambda w, g: (scales_like_package(w, g)[0].T, scales_like_package(w, g)[1])),
     ["scales must be float32 [", "one per row and group"]),
    (dict(group_scales=_zero_scale), ["scale of group 0 of row 1 is 0.0", "finite and > 0", "1e-12"]),
    (dict(group_scales=_zero_point_16), ["zero point of group 0 of row 0 is 16", "[0, 15]"]),
    (dict(group_scales=lambda w, g: 1 / 0), ["your group_scales raised ZeroDivisionError"]),
    (dict(pack=_swapped), ["must be the HIGH nibble of byte 0", "codes[2b] | codes[2b + 1] << 4"]),
    (dict(pack=lambda c: c[:, 0::2].long() | (c[:, 1::2].long() << 4)), ["must be uint8", "got int64"]),
    (dict(pack=lambda c: c.to(torch.uint8)), ["must be uint8 [", "two codes per byte"]),
    (dict(pack=lambda c: c.numpy()), ["pack must return a torch.Tensor, got ndarray"]),
], ids=["not-a-pair", "float-zeros", "transposed-scales", "zero-scale", "zero-point-16", "raises", "swapped-nibbles",
        "int64-bytes", "unpacked", "numpy"])
def test_a_bad_return_is_one_line_naming_the_rule_and_the_model_is_untouched(kw, words):
    model = _model()
    with pytest.raises(WorkbenchError) as e:
        quantize_model(model, "w4a16:g64:asym", **kw)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("layer model.layers.0."), msg
    for w in words:
        assert w in msg, msg
    assert e.value.__cause__ is None and e.value.__suppress_context__
    assert _untouched(model)


@pytest.mark.parametrize("spec, kw, words", [
    ("w4a16:g64", dict(group_scales=scales_like_package), ["symmetric", ":asym"]),
    ("w8a16:g64:asym", dict(pack=pack_like_package), ["int4", "8-bit"]),
    ("w4a16:pt:asym", dict(group_scales=scales_like_package), ["per-tensor"]),
    ("w4a16:g64:asym:gptq", dict(pack=pack_like_package), ["round-to-nearest", "gptq"]),
    ("w4a16:g64:asym", dict(pack="pack_int4"), ["pack must be a function"]),
])
def test_settings_the_hooks_cannot_serve_are_refused_before_anything_runs(spec, kw, words):
    model, calls = _model(), []
    fn = kw.get("group_scales") or kw.get("pack")
    if callable(fn):
        kw = {k: (lambda *a, _f=fn: calls.append(1) or _f(*a)) for k in kw}
    with pytest.raises(ConfigError) as e:
        quantize_model(model, spec, calibration=[[1, 2, 3, 4]], **kw)
    for w in words:
        assert w in str(e.value), str(e.value)
    assert not calls and _untouched(model)


def test_quantize_weight_refuses_hooks_with_a_clip_multiplier():
    w = torch.randn(4, 16)
    with pytest.raises(ConfigError, match="scale_multiplier"):
        quantize_weight(w, bits=4, group=8, symmetric=False, scale_multiplier=torch.ones(4, 2),
                        group_scales=scales_like_package)
    with pytest.raises(ConfigError, match="does not divide"):
        quantize_weight(w, bits=4, group=6, symmetric=False, group_scales=scales_like_package)


def test_a_plain_nn_module_and_the_head_take_the_hooks_too():
    net = nn.Sequential(nn.Linear(32, 16), nn.ReLU(), nn.Linear(16, 8))
    ref = quantize_model(copy.deepcopy(net), "w4a16:g16:asym")
    mine = quantize_model(net, "w4a16:g16:asym", group_scales=scales_like_package, pack=pack_like_package)
    x = torch.randn(3, 32)
    assert torch.equal(ref(x), mine(x))
    head_ref = quantize_model(_model(), "w4a16:g64:asym:head")
    head_mine = quantize_model(_model(), "w4a16:g64:asym:head", group_scales=scales_like_package,
                               pack=pack_like_package)
    assert torch.equal(head_ref.lm_head.q.qweight, head_mine.lm_head.q.qweight)
