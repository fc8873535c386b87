"""Int8 activations: per-token int8 quantization (``quantize_per_token_int8``) and W4A8 / W8A8
(``_wxa8_matmul_fwd_kernel``: int8 x int8 products summed in int32 per group, each group's sum
scaled once), their host wrappers and the torch references.  Math:
:mod:`workbench_kernels.quant_matmul`; plans: :mod:`workbench_kernels.quant_plan`; shared
helpers: :mod:`workbench_kernels.quant_shared`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import check_device, count_launch, interpreter_active
from .quant_plan import _launch_opts, wxa8_plan
from .quant_shared import (
    _ACT_DTYPES,
    _check,
    _int_values,
    _load_int_halves,
    _load_x_t,
    _reduce,
    _rows,
    _store_out,
)

XS_FLOOR = 1e-12                 # per-token scale floor: xs = max(max|x|, 1e-12) / 127


# ---- per-token int8 activations -------------------------------------------------------------------

@triton.jit
def _round_half_even(v):
    """torch.round of fp32 ``v`` (ties to even), exactly: ``floor`` and the exact remainder."""
    r = tl.floor(v)
    d = v - r                                   # exact, in [0, 1)
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    up = (d > 0.5) | ((d == 0.5) & odd)
    return tl.where(up, r + 1.0, r)


@triton.jit
def _quantize_per_token_int8_fwd_kernel(
    X,                  # *in  x [M, K] float32 / bfloat16 / float16 (strides stride_xm, stride_xk)
    XQ,                 # *out xq int8 [M, K] contiguous
    XS,                 # *out xs float32 [M] (the [M, 1] result, contiguous)
    K, stride_xm, stride_xk,
    BLOCK_K: tl.constexpr,
):
    """One program per row m, two passes over the row::

        xs = max(max_k |x[m, k]|, 1e-12) / 127;   xq = clamp(round_half_even(x / xs), -127, 127)

    in fp32 with correctly rounded divisions (``div_rn``: torch's), so xq and xs equal
    ``quantize_per_token_int8_ref`` (= ``workbench.quant.apply.fake_quantize_per_token``'s grid)."""
    m = tl.program_id(0).to(tl.int64)
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + m * stride_xm + cols * stride_xk, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    xs = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), 127.0)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + m * stride_xm + cols * stride_xk, mask=cols < K, other=0.0).to(tl.float32)
        q = _round_half_even(tl.math.div_rn(x, xs + tl.zeros_like(x)))
        q = tl.minimum(tl.maximum(q, -127.0), 127.0)
        tl.store(XQ + m * K + cols, q.to(tl.int8), mask=cols < K)
    tl.store(XS + m, xs)


# ---- W4A8 / W8A8 ----------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M", "stride_sn"])     # fewer compiles: every m of a BLOCK_M, any groups per row
def _wxa8_matmul_fwd_kernel(
    XQ,                 # *in  xq int8 [M, K] contiguous (quantize_per_token_int8)
    XS,                 # *in  xs float32 [M] per-token scales
    WQ,                 # *in  qweight: int4 uint8 [N, K // 2] (BITS=4, symmetric: nibble = q + 8) or int8 [N, K]
    S,                  # *in  scales float32 [N, n_groups] (stride_sn may be 0)
    BIAS,               # *in  bias [N] (read only when HAS_BIAS)
    OUT,                # *out y [M, N] contiguous (split_k = 1) or fp32 partials [split_k, M, N]
    M, N, K, KS,        # rows, out features, in features, storage columns of a weight row
    group_s,            # storage columns per group (int4: group // 2)
    cs_per_split,       # storage columns per split (a multiple of group_s)
    stride_wn, stride_sn, stride_sg,
    BITS: tl.constexpr, HAS_BIAS: tl.constexpr,
    USE_DOT: tl.constexpr,      # int8 x int8 -> int32 tl.dot (BLOCK_M, BLOCK_N >= 16, BLOCK_K // 2 >= 32);
                                # else int32 tl.sum
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Grid (N / BLOCK_N, M / BLOCK_M, split_k); split covers whole groups.  Per group::

        acc_i32[n, m] = sum_{k in group} q[n, k] xq[m, k]       (exact: |sum| <= group * 127 * 127)
        acc[n, m]    += s[n, g] * acc_i32[n, m]
    then ``acc * xs[m]`` (+ bias).  Steps of BLOCK_K columns cover a group (masked past its end
    when BLOCK_K does not divide it).  Reference: ``w4a8_matmul_ref``."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    n_ok, m_ok = offs_n < N, rows < M
    n64 = offs_n.to(tl.int64)
    STEP = BLOCK_K // 2 if BITS == 4 else BLOCK_K          # storage columns per step
    c_start = split * cs_per_split
    c_end = tl.minimum(c_start + cs_per_split, KS)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for g0 in range(c_start, c_end, group_s):
        g_end = tl.minimum(g0 + group_s, c_end)
        k_end = g_end * 2 if BITS == 4 else g_end
        acc_i = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.int32)
        for c0 in range(g0, g_end, STEP):
            qa, qb, cols_a, cols_b = _load_int_halves(WQ, offs_n, n_ok, c0, g_end, stride_wn, BITS, BLOCK_K)
            if BITS == 4:
                qa -= 8
                qb -= 8
            if USE_DOT:
                acc_i += tl.dot(qa.to(tl.int8), _load_x_t(XQ, rows, m_ok, cols_a, k_end, K, 1))
                acc_i += tl.dot(qb.to(tl.int8), _load_x_t(XQ, rows, m_ok, cols_b, k_end, K, 1))
            else:
                for r in tl.static_range(BLOCK_M):
                    row = (tl.program_id(1) * BLOCK_M + r).to(tl.int64)
                    # a tensor (3.9 interpreter: no scalar & tensor masks); not zeros_like: a jit call
                    row_ok = (cols_a * 0 + row) < M
                    xa = tl.load(XQ + row * K + cols_a, mask=row_ok & (cols_a < k_end), other=0).to(tl.int32)
                    xb = tl.load(XQ + row * K + cols_b, mask=row_ok & (cols_b < k_end), other=0).to(tl.int32)
                    part = tl.sum(qa * xa[None, :] + qb * xb[None, :], axis=1)
                    acc_i = tl.where(tl.arange(0, BLOCK_M)[None, :] == r, acc_i + part[:, None], acc_i)
        s = tl.load(S + n64 * stride_sn + (g0 // group_s) * stride_sg, mask=n_ok, other=0.0)
        acc += acc_i.to(tl.float32) * s[:, None]
    xs = tl.load(XS + rows, mask=m_ok, other=0.0)
    _store_out(OUT, BIAS, acc * xs[None, :], offs_n, n_ok, rows, m_ok, split, M, N, HAS_BIAS)


# ---- per-token int8 -------------------------------------------------------------------------------

def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric int8 quantization of each row (token) of x [..., K] (float32 / bfloat16 /
    float16): ``xs = max(max|x_m|, 1e-12) / 127`` (float32 [M, 1]) and ``xq = round(x / xs)``
    clamped to [-127, 127] (int8 [M, K], M = the product of the leading dims).  Rounding: half to
    even, as ``torch.round``; the divisions correctly rounded, so both equal
    :func:`quantize_per_token_int8_ref` exactly (NaN / inf inputs are not handled)."""
    op = "quantize_per_token_int8"
    if not isinstance(x, torch.Tensor) or x.dtype not in _ACT_DTYPES:
        raise TypeError(f"{op}: x must be float32, bfloat16 or float16, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    if x.dim() < 1 or x.shape[-1] < 1:
        raise ValueError(f"{op}: x must be [..., K] with K >= 1, got shape {tuple(x.shape)}")
    check_device(_quantize_per_token_int8_fwd_kernel, x, op=op)
    K = x.shape[-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    xq = torch.empty((M, K), device=x.device, dtype=torch.int8)
    xs = torch.empty((M, 1), device=x.device, dtype=torch.float32)
    if M:
        interp = interpreter_active()
        block = min(triton.next_power_of_2(K), 1 << 14 if interp else 4096)
        extra = {} if interp else {"num_warps": 4 if block <= 2048 else 8}
        _quantize_per_token_int8_fwd_kernel[(M,)](x2, xq, xs, K, x2.stride(0), x2.stride(1), BLOCK_K=block, **extra)
        count_launch(op)
    return xq, xs


def quantize_per_token_int8_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: ``workbench.quant.apply.fake_quantize_per_token``'s grid, as integers."""
    xf = x.reshape(-1, x.shape[-1]).float()
    xs = xf.abs().amax(-1, keepdim=True).clamp_min(XS_FLOOR) / 127
    return torch.round(xf / xs).clamp(-127, 127).to(torch.int8), xs


# ---- W4A8 / W8A8 wrappers -------------------------------------------------------------------------

def _wxa8(op: str, bits: int, x, qweight, scales, zeros, group, bias, split_k, path) -> torch.Tensor:
    if zeros is not None:
        raise ValueError(f"{op}: zeros must be None: int8 activations need symmetric weights "
                         "(a zero point would add a sum(x) correction per group; not implemented)")
    N, K, _ = _check(op, bits, x, qweight, scales, None, group, bias)
    if bits == 4 and group % 2:
        raise ValueError(f"{op}: group must be even for packed int4 (got {group})")
    tensors = [x, qweight, scales] + ([bias] if bias is not None else [])
    check_device(_wxa8_matmul_fwd_kernel, *tensors, op=op)
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    out = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if M == 0:
        return out.view(*x.shape[:-1], N)
    xq, xs = quantize_per_token_int8(x2)
    plan = wxa8_plan(M, N, K, group, bits=bits, split_k=split_k, path=path, device=x.device)
    s = _rows(N, scales)
    ws = out if plan.split_k == 1 else torch.empty((plan.split_k, M, N), device=x.device, dtype=torch.float32)
    extra = {} if interpreter_active() else _launch_opts(plan)
    grid = (triton.cdiv(N, plan.block_n), triton.cdiv(M, plan.block_m), plan.split_k)
    half = 2 if bits == 4 else 1
    _wxa8_matmul_fwd_kernel[grid](xq, xs, qweight, s, s if bias is None else bias, ws, M, N, K, qweight.shape[1],
                                  group // half, plan.k_per_split // half, qweight.stride(0), s.stride(0), s.stride(1),
                                  BITS=bits, HAS_BIAS=bias is not None and plan.split_k == 1,
                                  USE_DOT=plan.path == "gemm", BLOCK_M=plan.block_m, BLOCK_N=plan.block_n,
                                  BLOCK_K=plan.block_k, **extra)
    count_launch(op)
    if plan.split_k > 1:
        _reduce(ws, bias, out)
    return out.view(*x.shape[:-1], N)


def w4a8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int,
                bias: torch.Tensor | None = None, split_k: int | None = None, *, zeros: torch.Tensor | None = None,
                path: str | None = None) -> torch.Tensor:
    """W4A8: x [..., K] rounded per token to int8 (:func:`quantize_per_token_int8`), int8 x int4
    products summed in int32 per group, scaled by the group scale, then the token scale ->
    [..., N] in x's dtype.  Symmetric int4 weights only (``zeros`` must be None).  Plan:
    :func:`w4a8_plan`."""
    return _wxa8("w4a8_matmul", 4, x, qweight, scales, zeros, group, bias, split_k, path)


def w8a8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, group: int,
                bias: torch.Tensor | None = None, split_k: int | None = None, *, zeros: torch.Tensor | None = None,
                path: str | None = None) -> torch.Tensor:
    """W8A8: :func:`w4a8_matmul` for a symmetric int8 weight [N, K]."""
    return _wxa8("w8a8_matmul", 8, x, qweight, scales, zeros, group, bias, split_k, path)


def _wxa8_ref(bits: int, x, qweight, scales, group, bias) -> torch.Tensor:
    K = x.shape[-1]
    N = qweight.shape[0]
    xq, xs = quantize_per_token_int8_ref(x)
    q = _int_values(qweight, None, bits, group, K).double()
    G = -(-K // group)
    pad = G * group - K
    xqd = F.pad(xq.double(), (0, pad)).view(-1, G, group)
    qd = F.pad(q, (0, pad)).view(N, G, group)
    dots = torch.einsum("mgk,ngk->mng", xqd, qd)                   # exact integers in float64
    y = (dots * scales.double().expand(N, -1)[None]).sum(-1) * xs.double()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype).view(*x.shape[:-1], N)


def w4a8_matmul_ref(x, qweight, scales, group, bias=None, split_k=None, *, zeros=None, path=None) -> torch.Tensor:
    """The reference: x quantized by :func:`quantize_per_token_int8_ref`, the per-group integer
    dot products exact in float64, times the group scales, summed, times the token scale (+ bias),
    rounded once to x's dtype."""
    return _wxa8_ref(4, x, qweight, scales, group, bias)


def w8a8_matmul_ref(x, qweight, scales, group, bias=None, split_k=None, *, zeros=None, path=None) -> torch.Tensor:
    """The reference of :func:`w8a8_matmul` (as :func:`w4a8_matmul_ref`)."""
    return _wxa8_ref(8, x, qweight, scales, group, bias)
