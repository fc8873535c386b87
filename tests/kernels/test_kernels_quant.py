"""Low-bit matmul kernels (``workbench_kernels.quant_matmul``: W4A16, W8A16, W4A8, W8A8 and the
per-token int8 quantizer) against their torch references, on a CPU under the Triton interpreter.

Weights are real ``QuantizedWeight`` objects (``workbench.quant.rtn.quantize_weight``), so the
kernels read the storage format the quantizer writes.  Shapes are small but awkward: N = 40 (not
a multiple of any block), K = 192 with groups of 32 and 64, per-channel K = 176 and K = 704
(not powers of two), m = 1 / 3 / 17 (one row, odd, past a 16-row tile), leading batch dims,
a bias, a strided x, split-K with an uneven last split, and both paths forced (``gemv``:
CUDA-core sums; ``gemm``: ``tl.dot``).

Tolerances:

* float32, W4A16 / W8A16: ``max|y - ref| <= 1e-3 * max|ref|`` (the contract's bound), where ref is
  ``F.linear(x, q.dequantize())``.  Measured here: <= 7e-7 (the same dequantized weights,
  summed in another order; the test also asserts <= 1e-5), so a wrong nibble, group or zero
  point (O(1)) cannot hide.
* bfloat16 / float16: Liger's criterion (``assert_lowp_close``): against an fp32 reference on
  the same inputs, our error is at most 2x that of torch's own ``F.linear`` in the dtype.
  Measured (relative L2): bf16 ours 3.3-3.5e-3 vs torch 2.3-2.8e-3 (the interpreter rounds
  fp32 -> bf16 toward zero; the GEMM under the interpreter multiplies the fp32 weight), fp16
  1.8-2.9e-4 vs 2.2-3.3e-4.
* Exact (``torch.equal``): the integer unpacking (scales 1, x = identity: y = the integer
  weight values), the per-token int8 quantizer (xq, xs) against its torch reference (same
  fp32 divisions, ties to even), the references against ``QuantizedWeight.dequantize``.
* W4A8 / W8A8: ``max|y - ref| <= 1e-5 * max|ref|`` against the float64 reference (int32 sums
  are exact; only the fp32 scale products round).  Measured: <= 1.2e-7.

Keep shapes small: every program is a Python loop iteration under the interpreter, and each
GEMV row of a tile a few more (~50-500 ms per call here).
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"        # before the kernel modules create their jit functions
pytest.importorskip("triton", reason="triton is not installed (the kernels need it, also on CPU)")

__import__("workbench")  # registers the workbench_kernels import name
import workbench_kernels  # noqa: E402
import workbench_kernels.quant_matmul as qm  # noqa: E402
from workbench.quant.apply import QuantLinear, fake_quantize_per_token  # noqa: E402
from workbench.quant.rtn import QuantizedWeight, pack_int4, quantize_weight  # noqa: E402
from workbench_kernels._testing import assert_lowp_close  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and "Interpreted" not in type(qm._wxa16_gemv_kernel).__name__:
    pytest.fail("the quant kernels were created for a GPU before TRITON_INTERPRET=1 was set: "
                "tests/conftest.py sets it on a machine without CUDA before anything imports triton", pytrace=False)

ON_GPU = DEVICE == "cuda"


def gpu_subset(params: list, keep: tuple) -> list:
    """All of ``params`` under the interpreter; on a GPU only those at ``keep``.  There every
    distinct combination of block sizes and flags is one Triton compile (~0.5 s), and the device
    check gives all its kernel tests 90 s: the GPU run confirms compilation and the hardware's
    arithmetic on a representative subset, the interpreter covers every case."""
    return [params[i] for i in keep] if ON_GPU else params


A16 = {4: (qm.w4a16_matmul, qm.w4a16_matmul_ref), 8: (qm.w8a16_matmul, qm.w8a16_matmul_ref)}
A8 = {4: (qm.w4a8_matmul, qm.w4a8_matmul_ref), 8: (qm.w8a8_matmul, qm.w8a8_matmul_ref)}
N = 40


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def weight(N: int, K: int, bits: int, group: int | None, symmetric: bool = True, seed: int = 1,
           per_channel: bool = True) -> QuantizedWeight:
    q = quantize_weight(randn(N, K, seed=seed), bits=bits, group=group, per_channel=per_channel,
                        symmetric=symmetric)
    return q


def rel_max(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.double().cpu(), want.double().cpu()
    assert got.shape == want.shape, f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-30))


def a16(bits, q, x, bias=None, **kw):
    return A16[bits][0](x, q.qweight, q.scales, q.zeros, q.group_size, bias=bias, **kw)


# ---- W4A16 / W8A16 in float32 -----------------------------------------------------------------------
# (bits, K, group, symmetric): int4 with groups 32 / 64 and per channel (K = 176: not a power of
# two), symmetric and asymmetric; int8 symmetric g64 and asymmetric per channel.
A16_WEIGHTS = [(4, 192, 32, True), (4, 192, 64, True), (4, 176, None, True),
               (4, 192, 32, False), (4, 192, 64, False), (4, 176, None, False),
               (8, 192, 64, True), (8, 176, None, False)]


@pytest.mark.parametrize("bits,K,group,sym", gpu_subset(A16_WEIGHTS, (1, 5, 7)), ids=lambda v: str(v))
def test_a16_fp32_matches_dequantized_linear(bits, K, group, sym):
    """Both paths forced at m = 1, 3 (as [1, 3, K]: a leading batch dim) and 17, each with and
    without split-K (3 splits: uneven) and with and without a bias."""
    q = weight(N, K, bits, group, sym, seed=K + bits)
    w = q.dequantize(torch.float32)
    bias = randn(N, seed=7)
    worst = 0.0
    for i, (m, path) in enumerate([(1, "gemv"), (1, "gemm"), (3, "gemv"), (3, "gemm"), (17, "gemv"), (17, "gemm")]):
        x = randn(1, 3, K, seed=m) if m == 3 else randn(m, K, seed=m)
        b = bias if i % 2 == 0 else None
        split_k = 3 if i % 3 == 1 else None
        y = a16(bits, q, x, b, path=path, split_k=split_k)
        assert y.shape == (*x.shape[:-1], N) and y.dtype == torch.float32
        err = rel_max(y, F.linear(x, w, b))
        assert err <= 1e-3, f"m={m} {path} split_k={split_k} bias={b is not None}: rel max error {err:.3g}"
        worst = max(worst, err)
    assert worst <= 1e-5, f"expected ~1e-7 (summation order only), got {worst:.3g}"


@pytest.mark.parametrize("group", [64, None], ids=["g64", "per-channel"])
def test_a16_k704(group):
    """K = 704 (Llama-ish, not a power of two) with group 64 and per channel (group = K = 704)."""
    q = weight(24, 704, 4, group, symmetric=group is None, seed=3)
    w = q.dequantize(torch.float32)
    for m, path in [(1, None), (5, None), (2, "gemm")]:
        x = randn(m, 704, seed=m)
        assert rel_max(a16(4, q, x, path=path), F.linear(x, w)) <= 1e-5


def test_a16_auto_plan_split_k_and_strided_x():
    """The auto plan (m = 2: gemv, m = 6: gemm), split_k = 2 and 5 (more splits than the K steps
    allow: clamped), and an x that is a column slice of a wider tensor (row stride > K)."""
    q = weight(N, 192, 4, 64, seed=4)
    w = q.dequantize(torch.float32)
    wide = randn(6, 300, seed=5)
    x = wide[:, 50:242]
    assert x.stride(0) == 300
    for m, split_k in [(2, None), (6, None), (2, 2), (6, 5)]:
        assert rel_max(a16(4, q, x[:m], split_k=split_k), F.linear(x[:m], w)) <= 1e-5


def test_a16_per_tensor_scale():
    """Per-tensor scales ``[1, 1]`` (expanded to every row without a copy)."""
    q = weight(N, 128, 8, None, per_channel=False, seed=6)
    assert q.scales.shape == (1, 1)
    x = randn(3, 128, seed=1)
    assert rel_max(a16(8, q, x), F.linear(x, q.dequantize(torch.float32))) <= 1e-5


def test_references_equal_dequantize():
    """The references dequantize exactly as ``QuantizedWeight.dequantize`` (same fp32 numbers)."""
    for bits, K, group, sym in A16_WEIGHTS[:6:2] + A16_WEIGHTS[6:]:
        q = weight(N, K, bits, group, sym, seed=9)
        for dtype in (torch.float32, torch.bfloat16):
            x = randn(3, K, dtype=dtype, seed=2)
            assert torch.equal(A16[bits][1](x, q.qweight, q.scales, q.zeros, q.group_size),
                               F.linear(x, q.dequantize(dtype)))


# ---- low precision --------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,dtype", gpu_subset([(4, torch.bfloat16), (8, torch.bfloat16), (4, torch.float16),
                                                     (8, torch.float16)], (0, 1, 2)), ids=str)
def test_a16_low_precision_within_2x_torch(bits, dtype):
    q = weight(N, 192, bits, 64, symmetric=bits == 4, seed=11)
    bias = randn(N, seed=3)
    for m, path, split_k in [(1, "gemv", 2), (17, "gemm", None)]:
        x = randn(m, 192, dtype=dtype, seed=m)
        b = bias.to(dtype)
        ours = a16(bits, q, x, b, path=path, split_k=split_k)
        assert ours.dtype == dtype
        torch_lowp = F.linear(x, q.dequantize(dtype), b)
        ref32 = F.linear(x.float(), q.dequantize(torch.float32), b.float())
        assert_lowp_close(ours, torch_lowp, ref32, name=f"w{bits}a16 {dtype} m={m} {path}")


# ---- exact integer unpacking ------------------------------------------------------------------------
@pytest.mark.parametrize("bits,sym", [(4, True), (4, False), (8, True), (8, False)],
                         ids=["int4-sym", "int4-asym", "int8-sym", "int8-asym"])
def test_unpacking_is_bit_exact(bits, sym):
    """Every stored value (all 256 bytes / all nibbles, random zero points), scales 1 and
    x = identity (m = K): y[k, n] = q[n, k] - z[n, k // group] exactly, on both paths."""
    K, group, n = 64, 32, 24
    g = torch.Generator().manual_seed(bits + sym)
    if bits == 4:
        nib = torch.randint(0, 16, (n, K), generator=g)
        nib[0, :16] = torch.arange(16)
        qweight = pack_int4(nib)
        values = nib - 8
    else:
        qweight = torch.randint(-128, 128, (n, K), generator=g, dtype=torch.int8)
        qweight.view(-1)[:256] = torch.arange(-128, 128, dtype=torch.int8)
        values = qweight.long()
    zeros = None
    if not sym:
        zeros = (torch.randint(0, 16, (n, K // group), generator=g) if bits == 4
                 else torch.randint(-128, 128, (n, K // group), generator=g)).to(torch.int8)
        values = (nib if bits == 4 else qweight.long()) - zeros.long().repeat_interleave(group, 1)
    scales = torch.ones(n, K // group)
    q = QuantizedWeight(*(t.to(DEVICE) if t is not None else None for t in (qweight, scales, zeros)),
                        bits, group, (n, K), torch.float32)
    expected = values.t().float()
    assert torch.equal(q.dequantize().t().cpu(), expected)          # the format, read by torch
    for dtype, path in [(torch.float32, "gemv"), (torch.float32, "gemm"), (torch.bfloat16, "gemm")]:
        x = torch.eye(K, dtype=dtype, device=DEVICE)
        y = a16(bits, q, x, path=path)
        assert torch.equal(y.float().cpu(), expected), f"{dtype} {path}"


# ---- per-token int8 ---------------------------------------------------------------------------------
def test_quantize_per_token_int8_equals_reference():
    """Rows: random, a zero row (xs = 1e-12 / 127, xq = 0), exact ties (max 127 -> xs = 1, so
    x / xs = 0.5, 1.5, 2.5, -0.5, -2.5: half to even), a huge and a tiny scale; bf16 / fp16 inputs
    and leading dims; K = 300 (not a power of two)."""
    x = randn(6, 300, seed=1, scale=3.0)
    x[1] = 0.0
    x[2, :6] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5])
    x[2, 6:] = 0.25
    x[3] *= 1e3                                  # (fp16 below: no overflow)
    x[4] *= 1e-6
    for t in (x, x.to(torch.bfloat16), x.to(torch.float16).view(2, 3, 300)):
        xq, xs = qm.quantize_per_token_int8(t)
        rq, rs = qm.quantize_per_token_int8_ref(t)
        assert xq.dtype == torch.int8 and xq.shape == (6, 300) and xs.shape == (6, 1) and xs.dtype == torch.float32
        assert torch.equal(xs, rs), "per-token scales differ"
        assert torch.equal(xq, rq), f"{int((xq != rq).sum())} quantized values differ"
    xq, xs = qm.quantize_per_token_int8(x)
    assert xq[2, :6].tolist() == [127, 0, 2, 2, 0, -2] and float(xs[2]) == 1.0
    assert not xq[1].any() and float(xs[1]) == pytest.approx(1e-12 / 127)
    # the grid QuantLinear's reference rounds to (workbench.quant.apply.fake_quantize_per_token)
    assert torch.equal(xq.float() * xs, fake_quantize_per_token(x))


# ---- W4A8 / W8A8 ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bits,K,group", gpu_subset([(4, 192, 64), (4, 176, None), (8, 192, 32), (8, 176, None)],
                                                     (0, 3)), ids=str)
def test_a8_matches_integer_reference(bits, K, group):
    q = weight(N, K, bits, group, seed=K + bits)
    fn, ref = A8[bits]
    bias = randn(N, seed=5)
    for i, (m, path) in enumerate([(1, "gemv"), (3, "gemv"), (3, "gemm"), (17, "gemm"), (5, None)]):
        x = randn(1, m, K, seed=m) if m == 3 else randn(m, K, seed=m)
        b = bias if i % 2 else None
        split_k = 2 if i in (1, 3) else None
        y = fn(x, q.qweight, q.scales, q.group_size, bias=b, split_k=split_k, path=path)
        assert y.shape == (*x.shape[:-1], N)
        err = rel_max(y, ref(x, q.qweight, q.scales, q.group_size, bias=b))
        assert err <= 1e-5, f"m={m} {path} split_k={split_k}: rel max error {err:.3g}"


def test_a8_bf16_output_and_k704():
    q = weight(24, 704, 4, None, seed=2)
    x = randn(2, 704, dtype=torch.bfloat16, seed=1)
    y = qm.w4a8_matmul(x, q.qweight, q.scales, 704)
    assert y.dtype == torch.bfloat16
    want = qm.w4a8_matmul_ref(x, q.qweight, q.scales, 704)
    assert rel_max(y, want) <= 2 ** -7          # one bf16 ulp of the largest output (two roundings to bf16)


# ---- end to end: QuantLinear -------------------------------------------------------------------------
@pytest.mark.parametrize("bits,group,sym,act_bits", gpu_subset([(4, 64, True, None), (4, 32, False, None),
                                                                 (8, None, False, None), (4, 64, True, 8),
                                                                 (8, 64, True, 8)], (0, 1, 3)), ids=str)
def test_quant_linear_end_to_end(bits, group, sym, act_bits):
    """A QuantLinear built from quantize_weight on a random weight: its buffers through the
    kernel equal its reference forward (F.linear(x, q.dequantize()) + bias; with int8
    activations the input first rounded per token, as the kernel does)."""
    K, n = 128, 48
    w = randn(n, K, seed=21)
    q = quantize_weight(w, bits=bits, group=group, symmetric=sym)
    layer = QuantLinear(q, randn(n, seed=22), {"act_bits": act_bits}, rel_error=0.0).to(DEVICE)
    x = randn(2, 3, K, seed=23)
    group_size = layer.group or layer.in_features
    if act_bits:
        y = A8[bits][0](x, layer.qweight, layer.scales, group_size, bias=layer.bias)
    else:
        y = A16[bits][0](x, layer.qweight, layer.scales, layer.zeros, group_size, bias=layer.bias)
    want = layer.reference_forward(x)
    assert torch.equal(want, F.linear(fake_quantize_per_token(x) if act_bits else x, q.dequantize(), layer.bias))
    assert rel_max(y, want) <= 1e-5


# ---- plans ------------------------------------------------------------------------------------------
def test_plans_on_a_gpu(monkeypatch):
    """What the wrappers launch on an H100/H200 (132 SMs), computed on the host from shapes only."""
    import workbench_kernels.quant_plan as plans     # where the plans read both

    monkeypatch.setattr(plans, "interpreter_active", lambda: False)
    monkeypatch.setattr(plans, "_num_sms", lambda device: 132)
    p = qm.w4a16_plan(1, 4096, 4096, 128)
    assert (p.path, p.block_m, p.block_n, p.block_k) == ("gemv", 1, 64, 128)
    assert p.split_k == 8 and p.k_per_split == 512 and p.group_aligned      # 64 tiles x 8 splits
    p = qm.w4a16_plan(4, 11008, 4096, 128)
    assert p.path == "gemv" and p.block_m == 4 and p.block_n == 16
    p = qm.w4a16_plan(16, 4096, 11008, 128)
    assert (p.path, p.block_m, p.block_n, p.block_k) == ("gemm", 16, 64, 128) and p.split_k > 1
    p = qm.w4a16_plan(512, 4096, 4096, 128)
    assert (p.path, p.block_m, p.block_n, p.block_k, p.split_k, p.num_warps) == ("gemm", 64, 128, 64, 1, 8)
    p = qm.w4a16_plan(1, 4096, 704, 704)             # per channel, K = 704: one group, aligned
    assert p.group_aligned and p.split_k * p.k_per_split >= 704 and p.k_per_split % p.block_k == 0
    p = qm.w4a16_plan(8, 4096, 4096, 16)             # groups of 16 < BLOCK_K: scales gathered per element
    assert not p.group_aligned and p.block_k >= 32
    p = qm.wxa8_plan(1, 4096, 704, 704)
    assert p.block_k == 64 and p.split_k == 1        # per channel: one group, no split
    p = qm.wxa8_plan(32, 4096, 4096, 128, bits=4)
    assert (p.path, p.block_m, p.block_k) == ("gemm", 32, 64) and p.k_per_split % 128 == 0
    assert qm.w4a16_plan(1, 4096, 4096, 128, path="gemm", split_k=3).describe() == "gemm split_k=3 BLOCK 16x64x128"


def test_split_k_launches_the_reduction():
    q = weight(N, 192, 4, 64, seed=1)
    x = randn(1, 192)
    before = dict(workbench_kernels.LAUNCHES)
    a16(4, q, x, split_k=3, path="gemv")
    after = workbench_kernels.LAUNCHES
    assert after["w4a16_matmul"] == before.get("w4a16_matmul", 0) + 1
    assert after["split_k_reduce"] == before.get("split_k_reduce", 0) + 1


# ---- errors -----------------------------------------------------------------------------------------
def test_errors_name_the_argument():
    q4 = weight(N, 64, 4, 32, seed=1)
    q8 = weight(N, 64, 8, 32, seed=1)
    x = randn(2, 64)
    with pytest.raises(TypeError, match="qweight"):
        qm.w4a16_matmul(x, q8.qweight, q8.scales, None, 32)             # int8 given to the int4 kernel
    with pytest.raises(TypeError, match="qweight"):
        qm.w8a16_matmul(x, q4.qweight, q4.scales, None, 32)
    with pytest.raises(TypeError, match="qweight"):
        qm.w4a16_matmul(x, q4.qweight.float(), q4.scales, None, 32)
    with pytest.raises(ValueError, match="x's last dimension.*K = 64"):
        qm.w4a16_matmul(randn(2, 62), q4.qweight, q4.scales, None, 32)
    with pytest.raises(TypeError, match="x must be"):
        qm.w4a16_matmul(x.to(torch.int32), q4.qweight, q4.scales, None, 32)
    with pytest.raises(TypeError, match="scales"):
        qm.w4a16_matmul(x, q4.qweight, q4.scales.half(), None, 32)
    with pytest.raises(ValueError, match="scales"):
        qm.w4a16_matmul(x, q4.qweight, q4.scales, None, 16)            # group 16 needs 4 scales per row
    with pytest.raises(ValueError, match="group"):
        qm.w4a16_matmul(x, q4.qweight, q4.scales, None, 0)
    with pytest.raises(TypeError, match="zeros"):
        qm.w4a16_matmul(x, q4.qweight, q4.scales, q4.scales, 32)
    with pytest.raises(ValueError, match="bias"):
        qm.w4a16_matmul(x, q4.qweight, q4.scales, None, 32, bias=randn(N + 1))
    with pytest.raises(ValueError, match="path"):
        qm.w4a16_matmul(x, q4.qweight, q4.scales, None, 32, path="fast")
    with pytest.raises(ValueError, match="split_k"):
        qm.w4a16_matmul(x, q4.qweight, q4.scales, None, 32, split_k=0)
    qa = weight(N, 64, 4, 32, symmetric=False)
    with pytest.raises(ValueError, match="zeros must be None"):
        qm.w4a8_matmul(x, qa.qweight, qa.scales, 32, zeros=qa.zeros)
    with pytest.raises(ValueError, match="zeros must be None"):
        qm.w8a8_matmul(x, q8.qweight, q8.scales, 32, zeros=q8.scales.to(torch.int8))
    with pytest.raises(TypeError, match="x must be"):
        qm.quantize_per_token_int8(x.to(torch.int8))
    if DEVICE == "cpu":
        with pytest.raises(ValueError, match="one device"):
            qm.w4a16_matmul(x, q4.qweight.to("meta"), q4.scales, None, 32)


def test_registered_in_kernels():
    wrappers, refs = workbench_kernels.KERNELS["quant_matmul"]
    for name in wrappers + refs:
        assert callable(getattr(qm, name))
