"""torch's packed int8 / int4 CPU matmuls against the dequantize-then-matmul reference."""

from __future__ import annotations

import pytest
import torch

from workbench.quant.apply import QuantLinear
from workbench.quant.cpu_ops import cpu_op, cpu_op_reason, cpu_op_timing
from workbench.quant.rtn import quantize_weight


def _layer(bits, bias=False, act_bits=None, **kw):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(96, 256, generator=g)
    b = torch.randn(96, generator=g) if bias else None
    return QuantLinear(quantize_weight(w, bits=bits, **kw), b, {"act_bits": act_bits}, 0.0)


@pytest.mark.parametrize("bits,kw", [(8, {}), (4, dict(group=32)), (4, dict(group=128)),
                                     (4, dict(group=64, symmetric=False)), (8, dict(act_bits=8))],
                         ids=["int8-pc", "int4-g32", "int4-g128", "int4-g64-asym", "w8a8-int_mm"])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_cpu_op_equals_the_reference(bits, kw, bias):
    layer = _layer(bits, bias, **kw)
    assert cpu_op_reason(layer) is None
    for rows in ((1, 3), (2, 5)):                   # 3 rows: the op; 10 rows: past the op's row limit
        x = torch.randn(*rows, 256, generator=torch.Generator().manual_seed(4))
        ref = layer.reference_forward(x)
        for op in (cpu_op(layer), cpu_op(layer, row_fallback=False)):
            got = op(x)
            assert got.shape == ref.shape
            assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5


def test_formats_without_an_op_say_why():
    assert "per output channel" in cpu_op_reason(_layer(8, group=32))
    assert "per output channel" in cpu_op_reason(_layer(8, symmetric=False))
    assert "groups of" in cpu_op_reason(_layer(4))                      # int4 per channel
    assert "int4 x int8" in cpu_op_reason(_layer(4, group=32, act_bits=8))
    assert "per output channel" in cpu_op_reason(_layer(8, group=32, act_bits=8))
    assert cpu_op(_layer(4, group=16)) is None


def test_timing_reports_every_side():
    r = cpu_op_timing(out=256, inp=256, m=1, repeats=2, rounds=2)
    sides = {row["side"] for row in r["rows"]}
    assert sides == {"dense fp32", "reference w4 (dequantize + matmul)", "int8pack (w8, per channel)",
                     "int8 reduce (w8, per channel, compiled)", "int4pack (w4, g128)",
                     "int_mm (w8a8, per channel x per token)"}
    assert all(row["ms_median"] > 0 and row["ms_min"] <= row["ms_median"] <= row["ms_max"] for row in r["rows"])
    by = {row["side"]: row for row in r["rows"]}
    assert by["int4pack (w4, g128)"]["weight_bytes"] < by["int8pack (w8, per channel)"]["weight_bytes"] \
        < by["dense fp32"]["weight_bytes"]
    assert by["int8pack (w8, per channel)"]["rel_error_vs_dense"] < 0.02
    assert by["int8 reduce (w8, per channel, compiled)"]["rel_error_vs_dense"] < 0.02


@pytest.mark.parametrize("out", [64, 96, 160, 32], ids=["one-block", "block+tail", "blocks+tail", "tail-only"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_int4_op_holds_the_only_copy_of_the_weight(out, symmetric):
    """torch's int4 CPU op takes over the layer's buffers: one copy of the packed weight (its
    layout), the row layout rebuilt from it exactly, outputs unchanged, and back to rows on a switch."""
    from workbench.quant.cpu_ops import INT4PACK_LAYOUT

    w = torch.randn(out, 256, generator=torch.Generator().manual_seed(5))
    layer = QuantLinear(quantize_weight(w, bits=4, group=64, symmetric=symmetric), None, {}, 0.0)
    before = layer.quantized
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(6))
    ref = layer.reference_forward(x)
    op = cpu_op(layer)
    assert layer.qweight_layout == INT4PACK_LAYOUT
    after = layer.quantized
    assert torch.equal(after.qweight, before.qweight) and torch.equal(after.scales, before.scales)
    packed = op.__closure__[op.__code__.co_freevars.index("packed")].cell_contents
    assert packed is layer.qweight                                         # the op reads the buffer itself
    assert op.extra_bytes == out * (256 // 64) * 8                        # its scales-and-zeros only
    assert float((op(x) - ref).abs().max() / ref.abs().max()) < 1e-5
    many = torch.randn(9, 256, generator=torch.Generator().manual_seed(7))  # past the op's rows: the reference
    assert torch.allclose(op(many), QuantLinear(before, None, {}, 0.0).reference_forward(many), atol=1e-5)
    layer.use_row_layout()
    assert layer.qweight_layout == "rows" and torch.equal(layer.qweight, before.qweight)


def test_set_quant_backend_switches_without_losing_the_int4_weight():
    from workbench.quant.apply import set_quant_backend

    model = torch.nn.Sequential(_layer(4, group=32))
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(8))
    ref = model(x)
    stored = model[0].quantized.qweight.clone()
    for backend in ("cpu", "reference", "cpu", "cpu", "reference"):
        summary = set_quant_backend(model, backend)
        assert torch.equal(model[0].quantized.qweight, stored)
        assert float((model(x) - ref).abs().max() / ref.abs().max()) < 1e-5
        if backend == "cpu":
            assert summary["extra_bytes"] == 96 * (256 // 32) * 8
