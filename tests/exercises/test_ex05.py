"""Notebook 05's exercises: the solutions and the package's own pass; planted mistakes fail on the case that
teaches them, with the rule named; the hook runs a learner's functions in the real quantizer."""

from __future__ import annotations

import pytest
import torch

from workbench.exercises import check_fn, get, load_solution
from workbench.exercises.ex05 import EXERCISES

IDS = [ex.id for ex in EXERCISES]


@pytest.mark.parametrize("eid", IDS)
def test_the_solution_and_the_reference_pass(eid):
    ex = get(eid)
    assert check_fn(ex, load_solution(eid)).passed, check_fn(ex, load_solution(eid))
    assert check_fn(ex, ex.reference).passed


@pytest.mark.parametrize("eid", IDS)
def test_the_stub_is_not_written_yet(eid):
    ns: dict = {}
    exec(get(eid).stub, ns)
    assert check_fn(get(eid), ns[get(eid).function]).status == "not written"


def test_there_are_three_exercises_with_hint_ladders():
    assert IDS == ["05.group_scales", "05.pack_int4", "05.dequantize"]
    for ex in EXERCISES:
        assert 2 <= len(ex.hints) <= 3 and 4 <= len(ex.cases()) <= 8 and ex.plugs_into


# ---- 05.group_scales: planted mistakes -------------------------------------------------------------------
def _scales(w, group, *, divide=15, include_zero=True, eps=1e-12, as_float=True, zeros_dtype=torch.int8,
            rounding=torch.round):
    out, n = w.shape
    g = (w.float() if as_float else w).reshape(out, n // group, group)
    lo, hi = g.amin(-1), g.amax(-1)
    if include_zero:
        lo, hi = lo.clamp(max=0), hi.clamp(min=0)
    s = (hi - lo) / divide
    if eps:
        s = s.clamp(min=eps)
    return s, rounding(-lo / s).clamp(0, 15).to(zeros_dtype)


SCALE_MISTAKES = {
    "no epsilon: a group of zeros gets scale 0": (
        lambda w, group: _scales(w, group, eps=0),
        "a group of zeros (group 3 of row 0)", ["group 3 of row 0", "max - min = 0", "the scale must not be 0",
                                                "1e-12"]),
    "the range does not include 0": (
        lambda w, group: _scales(w, group, include_zero=False),
        "a constant group of 0.5", ["group 0 of row 1", "is constant (0.5)", "the range must include 0"]),
    "off by one: 16 steps": (
        lambda w, group: _scales(w, group, divide=16),
        "two rows, two groups of 4", ["int4 has 16 codes, 0..15, so 15 steps", "not / 16"]),
    "zero points as float32": (
        lambda w, group: _scales(w, group, zeros_dtype=torch.float32),
        "two rows, two groups of 4", ["zeros: expected dtype torch.int8, got torch.float32",
                                      "zero points are int8"]),
    "scales in the weight's dtype": (
        lambda w, group: _scales(w, group, as_float=False),
        "a bfloat16 weight", ["scales: expected dtype torch.float32, got torch.bfloat16", "float32 (whatever"]),
    "zero points truncated, not rounded": (
        lambda w, group: _scales(w, group, rounding=torch.trunc),
        "a group of zeros", ["zero = round(-min / scale)", "truncating (int(), floor, ceil) is not rounding"]),
    "a scale per column block of the whole tensor, not per row": (
        lambda w, group: (lambda s, z: (s[:1].expand_as(s).contiguous(), z[:1].expand_as(z).contiguous()))(
            *_scales(w, group)),
        "two rows, two groups of 4", ["group 0 of row 1 (columns 0..3)", "one scale per row and per 4"]),
    "symmetric scales (max|w| / 7)": (
        lambda w, group: (lambda s, z: ((w.float().reshape(w.shape[0], -1, group).abs().amax(-1) / 7), z))(
            *_scales(w, group)),
        "two rows, two groups of 4", ["the symmetric scale max|w| / 7", "(max(w, 0) - min(w, 0)) / 15"]),
}


@pytest.mark.parametrize("name", list(SCALE_MISTAKES))
def test_group_scales_mistakes_name_the_case_and_the_rule(name):
    fn, case, words = SCALE_MISTAKES[name]
    r = check_fn(get("05.group_scales"), fn)
    assert r.status == "failed", name
    assert case in r.case, (name, r.case)
    for w in words:
        assert w in r.rule, (name, w, r.rule)


def test_all_negative_weights_without_zero_in_the_range_name_the_rule():
    """The edge cases in order stop at the constant group; a function wrong only on one-sided groups fails on
    the all-negative case."""
    def one_sided(w, group):
        s, z = _scales(w, group)
        x = w.float().reshape(w.shape[0], -1, group)
        neg = x.amax(-1) < 0
        s2 = torch.where(neg, (x.amax(-1) - x.amin(-1)) / 15, s)
        return s2, z
    r = check_fn(get("05.group_scales"), one_sided)
    assert "all-negative weights" in r.case
    assert "is all negative: max = max(w, 0) = 0" in r.rule and "The range must include 0" in r.rule


def test_a_property_based_failure_is_shrunk_to_a_small_weight():
    def wrong_on_wide_groups(w, group):                  # right on every edge case, wrong for groups of 8 past row 0
        s, z = _scales(w, group)
        if group == 8 and w.shape[0] > 1 and w.shape[1] > 8:
            s = s * 1.01
        return s, z
    r = check_fn(get("05.group_scales"), wrong_on_wide_groups)
    assert r.status == "failed" and "property-based" in r.case
    assert "group=8" in r.call and "shape=(2, 16)" in r.call          # the smallest such input
    assert "scale = (max - min) / 15" in r.rule


# ---- 05.pack_int4: planted mistakes ----------------------------------------------------------------------
PACK_MISTAKES = {
    "nibbles swapped": (lambda codes: (codes.to(torch.uint8)[:, 0::2] << 4) | codes.to(torch.uint8)[:, 1::2],
                        "one byte: codes 3 and 10", ["code 1 of row 0 must be the HIGH nibble of byte 0",
                                                     "3 | 10 << 4 = 163"]),
    "int64 bytes": (lambda codes: codes[:, 0::2].long() | (codes[:, 1::2].long() << 4),
                    "one byte", ["expected dtype torch.uint8, got torch.int64", "the packed weight is uint8"]),
    "first half with second half": (
        lambda codes: (lambda c, h: c[:, :h] | (c[:, h:] << 4))(codes.to(torch.uint8), codes.shape[1] // 2),
        "codes 0 and 15", ["byte 0 of row 0 holds codes 0 (low nibble) and 1 (high nibble)", "neighbours"]),
    "three bits kept (codes above 7 lose their top bit)": (
        lambda codes: (codes.to(torch.uint8)[:, 0::2] & 7) | ((codes.to(torch.uint8)[:, 1::2] & 7) << 4),
        "one byte", ["yours has low nibble 3 and high nibble 2"]),
    "pairs across rows": (lambda codes: codes.to(torch.uint8)[0::2] | (codes.to(torch.uint8)[1::2] << 4),
                          "one byte", ["expected shape (1, 1), got (0, 2)", "rows stay rows"]),
    "shifted by a byte, not a nibble": (
        lambda codes: codes.to(torch.uint8)[:, 0::2] | (codes.to(torch.uint8)[:, 1::2] << 8),
                                        "one byte", ["yours has low nibble 3 and high nibble 0"]),
}


@pytest.mark.parametrize("name", list(PACK_MISTAKES))
def test_pack_mistakes_name_the_case_and_the_rule(name):
    fn, case, words = PACK_MISTAKES[name]
    r = check_fn(get("05.pack_int4"), fn)
    assert r.status == "failed", name
    assert case in r.case, (name, r.case)
    for w in words:
        assert w in r.rule, (name, w, r.rule)


# ---- 05.dequantize: planted mistakes ---------------------------------------------------------------------
def _dq(packed, scales, zeros, group, *, order=("lo", "hi"), cat=False, zero=True, repeat=False):
    lo, hi = packed & 0x0F, packed >> 4
    parts = [lo, hi] if order == ("lo", "hi") else [hi, lo]
    codes = (torch.cat(parts, -1) if cat else torch.stack(parts, -1).reshape(packed.shape[0], -1)).float()
    spread = (lambda t: t.repeat(1, group)) if repeat else (lambda t: t.repeat_interleave(group, 1))
    z = spread(zeros.float()) if zero else 0.0
    return (codes - z) * spread(scales)


DQ_MISTAKES = {
    "no zero point": (lambda packed, scales, zeros, group: _dq(packed, scales, zeros, group, zero=False),
                      "one byte, one group", ["subtract the zero point before scaling", "(3 - 8) * 0.5"]),
    "nibbles swapped": (lambda packed, scales, zeros, group: _dq(packed, scales, zeros, group, order=("hi", "lo")),
                        "one byte, one group", ["column 0 is the low nibble of byte 0", "even columns low"]),
    "groups tiled (repeat) instead of spread": (
        lambda packed, scales, zeros, group: _dq(packed, scales, zeros, group, repeat=True),
        "two groups of 4", ["column 1 is in group 1 // 4 = 0", "repeat_interleave, not repeat"]),
    "nibbles concatenated": (lambda packed, scales, zeros, group: _dq(packed, scales, zeros, group, cat=True),
                             "two groups of 4", ["the unpacked columns interleave", "concatenating"]),
    "a float64 result": (lambda packed, scales, zeros, group: _dq(packed, scales, zeros, group).double(),
                         "one byte, one group", ["expected dtype torch.float32, got torch.float64"]),
}


@pytest.mark.parametrize("name", list(DQ_MISTAKES))
def test_dequantize_mistakes_name_the_case_and_the_rule(name):
    fn, case, words = DQ_MISTAKES[name]
    r = check_fn(get("05.dequantize"), fn)
    assert r.status == "failed", name
    assert case in r.case, (name, r.case)
    for w in words:
        assert w in r.rule, (name, w, r.rule)


# ---- the plug-in: the learner's functions in the real quantizer ----------------------------------------------
def test_the_solutions_quantize_a_model_bit_for_bit_like_the_package():
    from workbench.model.config import ModelConfig
    from workbench.model.decoder import CausalLM, init_weights
    from workbench.quant.apply import QuantLinear, quantize_model

    cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True, eos_token_id=0)
    ref = quantize_model(init_weights(CausalLM(cfg), seed=1).eval(), "w4a16:g64:asym")
    mine = quantize_model(init_weights(CausalLM(cfg), seed=1).eval(), "w4a16:g64:asym",
                          group_scales=load_solution("05.group_scales"), pack=load_solution("05.pack_int4"))
    dq = load_solution("05.dequantize")
    for (n, a), (_, b) in zip(ref.named_modules(), mine.named_modules()):
        if isinstance(a, QuantLinear):
            for buf in ("qweight", "scales", "zeros"):
                assert torch.equal(getattr(a, buf), getattr(b, buf)), (n, buf)
            assert torch.equal(dq(b.qweight, b.scales, b.zeros, b.group), a.quantized.dequantize(torch.float32)), n
    ids = torch.arange(10)[None]
    assert torch.equal(ref(ids), mine(ids))
