"""W4A16 / W8A16: int4 / int8 weights dequantized inside the kernel, activations in float32 /
bfloat16 / float16 -- the split-K GEMV (``_wxa16_gemv_kernel``, a few rows) and the tensor-core
GEMM (``_wxa16_gemm_kernel``), their host wrappers ``w4a16_matmul`` / ``w8a16_matmul`` and the
torch references.  Storage, math and paths: :mod:`workbench_kernels.quant_matmul`; plans:
:mod:`workbench_kernels.quant_plan`; shared helpers: :mod:`workbench_kernels.quant_shared`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import check_device, count_launch, interpreter_active
from .quant_plan import _launch_opts, w4a16_plan
from .quant_shared import (
    _check,
    _int_values,
    _load_int_halves,
    _load_x_t,
    _reduce,
    _rows,
    _store_out,
)

# ---- device helper ---------------------------------------------------------------------------------

@triton.jit
def _dequant(q, cols, offs_n, n_ok, c0, k_end, S, Z, group, stride_sn, stride_sg, stride_zn, stride_zg,
             BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, GROUP_ALIGNED: tl.constexpr):
    """``(q - z) * s`` in fp32 for a half tile ``q`` [BLOCK_N, BLOCK_K // 2] of input columns
    ``cols`` (step starting at storage column ``c0``).  GROUP_ALIGNED (the whole step lies in one
    group): one scale (and zero) per row; otherwise each element's group ``cols // group`` is
    gathered.  Without zero points ``z`` is 8 (int4: nibble = q + 8) or 0 (int8)."""
    n64 = offs_n.to(tl.int64)
    if GROUP_ALIGNED:
        if BITS == 4:
            g = (2 * c0) // group
        else:
            g = c0 // group
        s = tl.load(S + n64 * stride_sn + g * stride_sg, mask=n_ok, other=0.0)[:, None]
        if HAS_ZEROS:
            z = tl.load(Z + n64 * stride_zn + g * stride_zg, mask=n_ok, other=0).to(tl.int32)[:, None]
        else:
            z = 8 if BITS == 4 else 0
    else:
        g = cols // group
        ok = n_ok[:, None] & (cols[None, :] < k_end)
        s = tl.load(S + n64[:, None] * stride_sn + g[None, :] * stride_sg, mask=ok, other=0.0)
        if HAS_ZEROS:
            z = tl.load(Z + n64[:, None] * stride_zn + g[None, :] * stride_zg, mask=ok, other=0).to(tl.int32)
        else:
            z = 8 if BITS == 4 else 0
    return (q - z).to(tl.float32) * s



# ---- W4A16 / W8A16 --------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M", "stride_sn"])     # fewer compiles: every m of a BLOCK_M, any groups per row
def _wxa16_gemv_kernel(
    X,                  # *in  x [M, K] float32 / bfloat16 / float16 (strides stride_xm, stride_xk)
    WQ,                 # *in  qweight: int4 uint8 [N, K // 2] (BITS=4) or int8 [N, K]; row stride stride_wn,
                        #      K contiguous
    S,                  # *in  scales float32 [N, n_groups] (stride_sn may be 0: a per-tensor scale expanded)
    Z,                  # *in  zeros int8 [N, n_groups] (read only when HAS_ZEROS)
    BIAS,               # *in  bias [N] (read only when HAS_BIAS)
    OUT,                # *out y [M, N] contiguous (split_k = 1) or fp32 partials [split_k, M, N]
    M, N, KS, group,    # rows, out features, storage columns of a weight row (K // 2 int4, K int8),
                        # input columns per scale
    cs_per_split,       # storage columns per split (a multiple of the step)
    stride_xm, stride_xk, stride_wn, stride_sn, stride_sg, stride_zn, stride_zg,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_ALIGNED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Split-K GEMV, grid (N / BLOCK_N, M / BLOCK_M, split_k): one program reduces the storage
    columns ``[split * cs_per_split, +cs_per_split)`` for BLOCK_N outputs and BLOCK_M rows::

        acc[n, m] += sum_j Wdq[n, cols_j] * x[m, cols_j]     (fp32, both halves; tl.sum)

    row by row (``tl.static_range(BLOCK_M)``) against the tile dequantized once: 2-D tensors only
    (a 3-D broadcast product took ~250 registers per thread under Triton 3.6).

    ``Wdq = (q - z) * s`` in fp32 (not rounded to x's dtype).  Reference: ``w4a16_matmul_ref``."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    n_ok, m_ok = offs_n < N, rows < M
    STEP = BLOCK_K // 2 if BITS == 4 else BLOCK_K          # storage columns per step
    c_start = split * cs_per_split
    c_end = tl.minimum(c_start + cs_per_split, KS)
    k_end = c_end * 2 if BITS == 4 else c_end
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for c0 in range(c_start, c_end, STEP):
        qa, qb, cols_a, cols_b = _load_int_halves(WQ, offs_n, n_ok, c0, c_end, stride_wn, BITS, BLOCK_K)
        wa = _dequant(qa, cols_a, offs_n, n_ok, c0, k_end, S, Z, group, stride_sn, stride_sg, stride_zn,
                      stride_zg, BITS, HAS_ZEROS, GROUP_ALIGNED)
        wb = _dequant(qb, cols_b, offs_n, n_ok, c0, k_end, S, Z, group, stride_sn, stride_sg, stride_zn,
                      stride_zg, BITS, HAS_ZEROS, GROUP_ALIGNED)
        xa_ptr = X + cols_a.to(tl.int64) * stride_xk
        xb_ptr = X + cols_b.to(tl.int64) * stride_xk
        for r in tl.static_range(BLOCK_M):      # the dequantized tile stays in registers for every row
            row = (tl.program_id(1) * BLOCK_M + r).to(tl.int64)
            # a tensor (3.9 interpreter: no scalar & tensor masks); not zeros_like: a jit call
            row_ok = (cols_a * 0 + row) < M
            xa = tl.load(xa_ptr + row * stride_xm, mask=row_ok & (cols_a < k_end), other=0).to(tl.float32)
            xb = tl.load(xb_ptr + row * stride_xm, mask=row_ok & (cols_b < k_end), other=0).to(tl.float32)
            part = tl.sum(wa * xa[None, :] + wb * xb[None, :], axis=1)            # [BLOCK_N]
            acc = tl.where(tl.arange(0, BLOCK_M)[None, :] == r, acc + part[:, None], acc)
    _store_out(OUT, BIAS, acc, offs_n, n_ok, rows, m_ok, split, M, N, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "stride_sn"])     # fewer compiles: every m of a BLOCK_M, any groups per row
def _wxa16_gemm_kernel(
    X,                  # *in  x [M, K] float32 / bfloat16 / float16 (strides stride_xm, stride_xk)
    WQ,                 # *in  qweight: int4 uint8 [N, K // 2] (BITS=4) or int8 [N, K]; row stride stride_wn,
                        #      K contiguous
    S,                  # *in  scales float32 [N, n_groups] (stride_sn may be 0)
    Z,                  # *in  zeros int8 [N, n_groups] (read only when HAS_ZEROS)
    BIAS,               # *in  bias [N] (read only when HAS_BIAS)
    OUT,                # *out y [M, N] contiguous (split_k = 1) or fp32 partials [split_k, M, N]
    M, N, KS, group, cs_per_split,     # as in _wxa16_gemv_kernel
    stride_xm, stride_xk, stride_wn, stride_sn, stride_sg, stride_zn, stride_zg,
    BITS: tl.constexpr, HAS_ZEROS: tl.constexpr, HAS_BIAS: tl.constexpr, GROUP_ALIGNED: tl.constexpr,
    DOT_FP32: tl.constexpr,     # fp32 IEEE products: fp32 x, and any x under the interpreter (its bf16 dot is wrong)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Tiled GEMM with fused dequantization, grid (N / BLOCK_N, M / BLOCK_M, split_k)::

        acc[BLOCK_N, BLOCK_M] += dot(Wdq[:, cols_a], x[:, cols_a]^T) + dot(Wdq[:, cols_b], x[:, cols_b]^T)

    ``Wdq = ((q - z) * s)`` rounded to x's dtype for the tensor cores (as the reference's
    dequantized weight), fp32 accumulation; the transposed product puts the weight rows on the
    MMA's M side.  DOT_FP32 (fp32 x; any x under the interpreter, whose bf16 dot is wrong and
    whose fp32 -> bf16 casts truncate): fp32 Wdq and IEEE fp32 products.
    Reference: ``w4a16_matmul_ref``."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    n_ok, m_ok = offs_n < N, rows < M
    STEP = BLOCK_K // 2 if BITS == 4 else BLOCK_K          # storage columns per step
    c_start = split * cs_per_split
    c_end = tl.minimum(c_start + cs_per_split, KS)
    k_end = c_end * 2 if BITS == 4 else c_end
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for c0 in range(c_start, c_end, STEP):
        qa, qb, cols_a, cols_b = _load_int_halves(WQ, offs_n, n_ok, c0, c_end, stride_wn, BITS, BLOCK_K)
        wa = _dequant(qa, cols_a, offs_n, n_ok, c0, k_end, S, Z, group, stride_sn, stride_sg, stride_zn,
                      stride_zg, BITS, HAS_ZEROS, GROUP_ALIGNED)
        wb = _dequant(qb, cols_b, offs_n, n_ok, c0, k_end, S, Z, group, stride_sn, stride_sg, stride_zn,
                      stride_zg, BITS, HAS_ZEROS, GROUP_ALIGNED)
        xa = _load_x_t(X, rows, m_ok, cols_a, k_end, stride_xm, stride_xk)
        xb = _load_x_t(X, rows, m_ok, cols_b, k_end, stride_xm, stride_xk)
        if DOT_FP32:        # the fp32 weight as it is (the interpreter would round it toward zero)
            acc += tl.dot(wa, xa.to(tl.float32), input_precision="ieee")
            acc += tl.dot(wb, xb.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(wa.to(X.dtype.element_ty), xa)
            acc += tl.dot(wb.to(X.dtype.element_ty), xb)
    _store_out(OUT, BIAS, acc, offs_n, n_ok, rows, m_ok, split, M, N, HAS_BIAS)


# ---- W4A16 / W8A16 wrappers -----------------------------------------------------------------------

def _wxa16(op: str, bits: int, x, qweight, scales, zeros, group, bias, split_k, path) -> torch.Tensor:
    N, K, _ = _check(op, bits, x, qweight, scales, zeros, group, bias)
    if bits == 4 and K % 2:
        raise ValueError(f"{op}: K must be even for packed int4")
    tensors = [x, qweight, scales] + [t for t in (zeros, bias) if t is not None]
    check_device(_wxa16_gemv_kernel, *tensors, op=op)
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0:
        return out.view(*x.shape[:-1], N)
    plan = w4a16_plan(M, N, K, group, split_k=split_k, path=path, bits=bits, device=x.device)
    s, z = _rows(N, scales), _rows(N, zeros)
    ws = out if plan.split_k == 1 else torch.empty((plan.split_k, M, N), device=x.device, dtype=torch.float32)
    interp = interpreter_active()
    extra = {} if interp else _launch_opts(plan)
    grid = (triton.cdiv(N, plan.block_n), triton.cdiv(M, plan.block_m), plan.split_k)
    cs = plan.k_per_split // 2 if bits == 4 else plan.k_per_split
    args = (x2, qweight, s, s if z is None else z, s if bias is None else bias, ws, M, N, qweight.shape[1], group, cs,
            x2.stride(0), x2.stride(1), qweight.stride(0), s.stride(0), s.stride(1),
            0 if z is None else z.stride(0), 0 if z is None else z.stride(1))
    meta = dict(BITS=bits, HAS_ZEROS=zeros is not None, HAS_BIAS=bias is not None and plan.split_k == 1,
                GROUP_ALIGNED=plan.group_aligned, BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k)
    if plan.path == "gemv":
        _wxa16_gemv_kernel[grid](*args, **meta, **extra)
    else:
        _wxa16_gemm_kernel[grid](*args, **meta, DOT_FP32=x.dtype == torch.float32 or interp, **extra)
    count_launch(op)
    if plan.split_k > 1:
        _reduce(ws, bias, out)
    return out.view(*x.shape[:-1], N)


def w4a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group: int, bias: torch.Tensor | None = None, split_k: int | None = None, *,
                 path: str | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for an int4 weight, dequantized inside the kernel -> [..., N] in x's dtype.

    x [..., K] float32 / bfloat16 / float16 (any strides); qweight uint8 [N, K // 2] (two values
    per byte, low nibble = even column); scales float32 [N, ceil(K / group)] or [1, 1];
    zeros int8 like scales (asymmetric: value = nibble - zero) or None (symmetric: nibble - 8);
    ``group``: input columns per scale (per-channel: K).  ``split_k`` / ``path`` ("gemv" /
    "gemm") override :func:`w4a16_plan`, which says what runs."""
    return _wxa16("w4a16_matmul", 4, x, qweight, scales, zeros, group, bias, split_k, path)


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None,
                 group: int, bias: torch.Tensor | None = None, split_k: int | None = None, *,
                 path: str | None = None) -> torch.Tensor:
    """:func:`w4a16_matmul` for an int8 weight [N, K] (asymmetric: value = stored - zeros_stored,
    both stored minus 128)."""
    return _wxa16("w8a16_matmul", 8, x, qweight, scales, zeros, group, bias, split_k, path)



def _dequantize_ref(qweight, scales, zeros, group, bits, K) -> torch.Tensor:
    """W [N, K] in float32, as ``QuantizedWeight.dequantize`` computes it ((q - z) * s in fp32)."""
    N = qweight.shape[0]
    s = scales.expand(N, -1).repeat_interleave(group, dim=1)[:, :K]
    return _int_values(qweight, zeros, bits, group, K) * s


def w4a16_matmul_ref(x, qweight, scales, zeros, group, bias=None, split_k=None, *, path=None) -> torch.Tensor:
    """The reference: W dequantized in fp32 (``(q - z) * s``, exactly ``QuantizedWeight.dequantize``),
    rounded to x's dtype, then ``F.linear`` in x's dtype."""
    K = x.shape[-1]
    w = _dequantize_ref(qweight, scales, zeros, group, 4, K).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


def w8a16_matmul_ref(x, qweight, scales, zeros, group, bias=None, split_k=None, *, path=None) -> torch.Tensor:
    """The reference of :func:`w8a16_matmul` (as :func:`w4a16_matmul_ref`)."""
    K = x.shape[-1]
    w = _dequantize_ref(qweight, scales, zeros, group, 8, K).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))
