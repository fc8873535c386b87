"""Low-bit weight matmuls with the dequantization fused in: W4A16, W8A16, W4A8, W8A8, in Triton.

Math.  A weight ``W [N = out, K = in]`` is stored as integers plus one float32 scale per output
channel and per ``group`` consecutive input columns (``workbench.quant.rtn``; per-channel:
``group = K``; per-tensor: ``scales [1, 1]``)::

    W[n, k] = (q[n, k] - z[n, g]) * s[n, g],      g = k // group
    y[m, n] = sum_k x[m, k] W[n, k]  (+ bias[n])                       y = x @ W^T

Storage (read as it is, never repacked):

* int4: ``qweight`` uint8 ``[N, K // 2]``, two columns per byte along K (low nibble = even column
  ``k``, high nibble = odd column ``k + 1``).  Symmetric: ``z = 8`` (nibble = q + 8, q in [-7, 7]);
  asymmetric: ``zeros`` int8 ``[N, n_groups]`` in [0, 15].
* int8: ``qweight`` int8 ``[N, K]``.  Symmetric: ``z = 0``; asymmetric: stored ``q - 128`` and
  ``zeros`` stored ``z - 128``, so ``q - z = stored - zeros_stored`` (the same subtraction).

The kernels never build W.  Each loop step loads a tile of stored integers, splits it into two
*halves* of ``BLOCK_K // 2`` input columns each -- int4: the low nibbles (even columns) and the
high nibbles (odd columns) of one run of bytes, so no interleaving is needed; int8: the first
and second half of the step's columns -- and multiplies each half by the matching columns of x
(a stride-2 gather of x for int4: x is small and cached, the weight bytes stay contiguous)::

    acc += Wdq[:, cols_a] @ x[:, cols_a]^T + Wdq[:, cols_b] @ x[:, cols_b]^T

Paths (:func:`w4a16_plan` picks one from the shape; ``path=`` / ``split_k=`` force them):

* ``gemv`` (``_wxa16_gemv_kernel``): a few rows (m <= :data:`GEMV_MAX_M`).  Products and sums on
  the CUDA cores (``tl.dot`` needs 16 rows): each step's weight tile is dequantized once, then
  multiplied by each of the BLOCK_M rows of x in turn (``tl.static_range``; 2-D tensors only) and
  reduced with ``tl.sum``.  Memory-bound: the weight bytes are the cost, so each program reads a
  slice of K (*split-K*) to have enough programs in flight.
* ``gemm`` (``_wxa16_gemm_kernel``): tensor cores (``tl.dot``) on the dequantized tile, cast to
  x's dtype (the rounding the reference makes), fp32 accumulation.  The product is computed
  transposed, ``acc[BLOCK_N, BLOCK_M] = Wdq @ x^T`` ("swap AB"), so the weight's N is the MMA's
  M dimension (64+ rows: wgmma-sized on Hopper) and the few token rows are its N (16+).
  Split-K too when the output tiles alone leave SMs idle.

Split-K writes fp32 partials to a workspace ``[split_k, M, N]`` which ``_split_k_reduce_kernel``
sums in a fixed order (deterministic: no atomics), adds the bias and casts; the plan depends on
shapes only, so there is no host sync (CUDA-graph safe).  With ``split_k = 1`` the kernel writes
y itself (bias added, cast once).

W4A8 / W8A8 (``_wxa8_matmul_fwd_kernel``, symmetric weights only): x is first rounded per token to
int8 (``quantize_per_token_int8``: ``xs = max(max|x_m|, 1e-12) / 127``, ``xq = round(x / xs)``,
ties to even); the integer products are summed in int32 over each group (exact: int8 x int8
``tl.dot`` -> int32 for 5+ rows, an int32 ``tl.sum`` below) and each group's sum scaled once::

    y[m, n] = xs[m] * sum_g s[n, g] * sum_{k in g} xq[m, k] q[n, k]

Bytes per call (the floor a memory-bound GEMV approaches)::

    W4A16  N K / 2 + 4 N n_groups (+ N n_groups zeros)  + 2 m K + 2 m N     (bf16 x and y)
    W8A16  N K     + 4 N n_groups ...                       dense bf16: 2 N K + ...

Checked without a GPU: the tests run every path under the interpreter; all kernels were
compiled ahead of time for sm_90 and sm_80 with Triton 3.6 and 3.9 (``workbench.transforms.
kernel_compile`` on meta-tensor launches of the wrappers: Llama-7B layer shapes, m = 1 .. 512,
bf16 / fp32) -- no failures; bf16, m <= 16: <= 128 registers per thread, no spills (m = 512 on
sm_80: a few dozen bytes of spill).  Not yet timed on a GPU: block sizes and GEMV_MAX_M are leads
for ``workbench.bench.quant_kernels``.

References (plain torch, next to each wrapper): ``w4a16_matmul_ref`` / ``w8a16_matmul_ref``
dequantize exactly as ``QuantizedWeight.dequantize`` and call ``F.linear`` in x's dtype;
``w4a8_matmul_ref`` / ``w8a8_matmul_ref`` multiply the integers in float64 (exact), then scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from . import check_device, count_launch, interpreter_active

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GEMV_MAX_M = 4          # rows up to which the auto plan takes the CUDA-core GEMV (a lead: tune on the GPU)
_REPRESENTATIVE_SMS = 132       # H100 / H200, for plans made without a CUDA device (meta tensors, AOT)
_MIN_K_PER_SPLIT = 256          # input columns a split reads at least (each split costs an fp32 partial)
_MAX_SPLIT_K = 32
XS_FLOOR = 1e-12                 # per-token scale floor: xs = max(max|x|, 1e-12) / 127


# ---- device helpers -------------------------------------------------------------------------------

@triton.jit
def _load_int_halves(WQ, offs_n, n_ok, c0, c_end, stride_wn, BITS: tl.constexpr, BLOCK_K: tl.constexpr):
    """One step of BLOCK_K input columns of rows ``offs_n``, from *storage* column ``c0`` (a byte
    for int4, an element for int8; columns >= ``c_end`` and rows >= N read 0), as two halves
    ``(qa, qb)`` [BLOCK_N, BLOCK_K // 2] int32 and their input columns ``(cols_a, cols_b)``.

    int4: one run of BLOCK_K // 2 bytes; ``qa`` = low nibbles (input columns 2c), ``qb`` = high
    nibbles (2c + 1), both in [0, 15].  int8: input columns ``c0 + j`` and ``c0 + BLOCK_K/2 + j``,
    sign-extended.  (Offsets and masks are in storage columns, contiguous from ``c0``, so the
    compiler can prove the 16-byte alignment a vectorised load needs.)"""
    j = tl.arange(0, BLOCK_K // 2)
    row = offs_n.to(tl.int64)[:, None] * stride_wn
    if BITS == 4:
        byte = c0 + j
        cols_a = 2 * byte
        cols_b = cols_a + 1
        p = tl.load(WQ + row + byte[None, :], mask=n_ok[:, None] & (byte[None, :] < c_end), other=0)
        p = p.to(tl.int32)                       # uint8 -> int32 zero-extends
        qa = p & 15
        qb = (p >> 4) & 15
    else:
        cols_a = c0 + j
        cols_b = cols_a + BLOCK_K // 2
        qa = tl.load(WQ + row + cols_a[None, :], mask=n_ok[:, None] & (cols_a[None, :] < c_end), other=0)
        qb = tl.load(WQ + row + cols_b[None, :], mask=n_ok[:, None] & (cols_b[None, :] < c_end), other=0)
        qa = qa.to(tl.int32)
        qb = qb.to(tl.int32)
    return qa, qb, cols_a, cols_b


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


@triton.jit
def _load_x_t(X, rows, m_ok, cols, k_end, stride_xm, stride_xk):
    """x[rows, cols] transposed: [BLOCK_K // 2, BLOCK_M] (zero outside the rows / before k_end)."""
    return tl.load(X + rows.to(tl.int64)[None, :] * stride_xm + cols.to(tl.int64)[:, None] * stride_xk,
                   mask=m_ok[None, :] & (cols[:, None] < k_end), other=0)


@triton.jit
def _store_out(OUT, BIAS, acc, offs_n, n_ok, rows, m_ok, split, M, N, HAS_BIAS: tl.constexpr):
    """acc [BLOCK_N, BLOCK_M] (+ bias) to ``OUT[split, rows, offs_n]`` (OUT: y [M, N] when split_k
    is 1, cast to its dtype; else the fp32 workspace [split_k, M, N])."""
    if HAS_BIAS:
        acc += tl.load(BIAS + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    base = split.to(tl.int64) * M * N
    ptr = OUT + base + rows.to(tl.int64)[None, :] * N + offs_n[:, None]
    tl.store(ptr, acc.to(OUT.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


# ---- W4A16 / W8A16 --------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["M", "stride_sn"])     # fewer compiles: every m of a BLOCK_M, any groups per row
def _wxa16_gemv_kernel(
    X,                  # *in  x [M, K] float32 / bfloat16 / float16 (strides stride_xm, stride_xk)
    WQ,                 # *in  qweight: int4 uint8 [N, K // 2] (BITS=4) or int8 [N, K]; row stride stride_wn, K contiguous
    S,                  # *in  scales float32 [N, n_groups] (stride_sn may be 0: a per-tensor scale expanded)
    Z,                  # *in  zeros int8 [N, n_groups] (read only when HAS_ZEROS)
    BIAS,               # *in  bias [N] (read only when HAS_BIAS)
    OUT,                # *out y [M, N] contiguous (split_k = 1) or fp32 partials [split_k, M, N]
    M, N, KS, group,    # rows, out features, storage columns of a weight row (K // 2 int4, K int8), input columns per scale
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
            row_ok = (cols_a * 0 + row) < M    # a tensor (3.9 interpreter: no scalar & tensor masks); not zeros_like: a jit call
            xa = tl.load(xa_ptr + row * stride_xm, mask=row_ok & (cols_a < k_end), other=0).to(tl.float32)
            xb = tl.load(xb_ptr + row * stride_xm, mask=row_ok & (cols_b < k_end), other=0).to(tl.float32)
            part = tl.sum(wa * xa[None, :] + wb * xb[None, :], axis=1)            # [BLOCK_N]
            acc = tl.where(tl.arange(0, BLOCK_M)[None, :] == r, acc + part[:, None], acc)
    _store_out(OUT, BIAS, acc, offs_n, n_ok, rows, m_ok, split, M, N, HAS_BIAS)


@triton.jit(do_not_specialize=["M", "stride_sn"])     # fewer compiles: every m of a BLOCK_M, any groups per row
def _wxa16_gemm_kernel(
    X,                  # *in  x [M, K] float32 / bfloat16 / float16 (strides stride_xm, stride_xk)
    WQ,                 # *in  qweight: int4 uint8 [N, K // 2] (BITS=4) or int8 [N, K]; row stride stride_wn, K contiguous
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


@triton.jit(do_not_specialize=["SPLITS"])
def _split_k_reduce_kernel(
    WS,                 # *in  fp32 partials [SPLITS, M, N] contiguous
    BIAS,               # *in  bias [N] (read only when HAS_BIAS)
    Y,                  # *out y [M, N] contiguous, in x's dtype
    MN, N, SPLITS,      # M * N, N, number of partials
    HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    """y = sum_s WS[s] (+ bias), summed in split order (deterministic), cast once."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < MN
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    ptr = WS + offs
    for _ in range(0, SPLITS):
        acc += tl.load(ptr, mask=ok, other=0.0)
        ptr += MN
    if HAS_BIAS:
        acc += tl.load(BIAS + offs % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + offs, acc.to(Y.dtype.element_ty), mask=ok)


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
    USE_DOT: tl.constexpr,      # int8 x int8 -> int32 tl.dot (BLOCK_M, BLOCK_N >= 16, BLOCK_K // 2 >= 32); else int32 tl.sum
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
                    row_ok = (cols_a * 0 + row) < M    # a tensor (3.9 interpreter: no scalar & tensor masks); not zeros_like: a jit call
                    xa = tl.load(XQ + row * K + cols_a, mask=row_ok & (cols_a < k_end), other=0).to(tl.int32)
                    xb = tl.load(XQ + row * K + cols_b, mask=row_ok & (cols_b < k_end), other=0).to(tl.int32)
                    part = tl.sum(qa * xa[None, :] + qb * xb[None, :], axis=1)
                    acc_i = tl.where(tl.arange(0, BLOCK_M)[None, :] == r, acc_i + part[:, None], acc_i)
        s = tl.load(S + n64 * stride_sn + (g0 // group_s) * stride_sg, mask=n_ok, other=0.0)
        acc += acc_i.to(tl.float32) * s[:, None]
    xs = tl.load(XS + rows, mask=m_ok, other=0.0)
    _store_out(OUT, BIAS, acc * xs[None, :], offs_n, n_ok, rows, m_ok, split, M, N, HAS_BIAS)


# ---- plans ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuantMatmulPlan:
    """What a wrapper launches for one shape: ``path`` ("gemv": CUDA-core sums; "gemm":
    ``tl.dot``), block sizes, ``split_k`` (programs along K) and ``k_per_split`` (input columns
    each reads), ``group_aligned`` (each BLOCK_K step lies in one group: one scale per row)."""
    path: str
    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    group_aligned: bool
    num_warps: int
    num_stages: int | None = None       # None: Triton's default

    def describe(self) -> str:
        return (f"{self.path} split_k={self.split_k} "
                f"BLOCK {self.block_m}x{self.block_n}x{self.block_k}")


_SM_COUNT: dict[int, int] = {}


def _num_sms(device) -> int:
    if device is not None and torch.device(device).type == "cuda":
        idx = torch.device(device).index
        idx = torch.cuda.current_device() if idx is None else idx
        if idx not in _SM_COUNT:
            _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        return _SM_COUNT[idx]
    return _REPRESENTATIVE_SMS


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= cap dividing n."""
    b = 1
    while b * 2 <= cap and n % (b * 2) == 0:
        b *= 2
    return b


def _split(tiles: int, K: int, unit: int, sms: int, gemv: bool, split_k: int | None) -> tuple[int, int]:
    """(split_k, k_per_split).  Unless ``split_k`` is given: when the output tiles alone are fewer
    than 2 x SMs (gemv: memory-bound, wants many loads in flight) or SMs (gemm), enough splits
    for 4 x SMs (gemv) / 2 x SMs (gemm) programs, each split >= _MIN_K_PER_SPLIT input columns,
    at most _MAX_SPLIT_K.  Split boundaries on multiples of ``unit``; no empty split."""
    units = -(-K // unit)
    if split_k is None:
        floor, target = (2 * sms, 4 * sms) if gemv else (sms, 2 * sms)
        want = -(-target // max(tiles, 1)) if tiles < floor else 1
        split_k = max(1, min(want, K // _MIN_K_PER_SPLIT, _MAX_SPLIT_K))
    split_k = max(1, min(int(split_k), units))
    k_per_split = -(-units // split_k) * unit
    return -(-K // k_per_split), k_per_split


def _check_plan_args(op: str, m: int, N: int, K: int, group: int, path: str | None, split_k: int | None) -> None:
    if path not in (None, "gemv", "gemm"):
        raise ValueError(f"{op}: path must be None, 'gemv' or 'gemm', got {path!r}")
    if split_k is not None and int(split_k) < 1:
        raise ValueError(f"{op}: split_k must be >= 1, got {split_k}")
    if min(m, N, K, group) < 1:
        raise ValueError(f"{op}: m, N, K and group must be >= 1, got m={m}, N={N}, K={K}, group={group}")


def _gemm_tiles(m: int, interp: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the tensor-core path on a GPU: 16 / 32 / 64 token rows
    against 64 weight rows (4 warps), 64 x 128 with 8 warps beyond 64 rows (measured with the
    ahead-of-time compiler for sm_90: <= 128 registers per thread at BLOCK_K = 64, no spills).
    Under the interpreter at most 32 x 64 (each program is a Python loop iteration)."""
    if interp:
        return (16 if m <= 16 else 32), 64, 4
    if m <= 64:
        return (16 if m <= 16 else 32 if m <= 32 else 64), 64, 4
    return 64, 128, 8


def w4a16_plan(m: int, N: int, K: int, group: int, *, split_k: int | None = None, path: str | None = None,
               bits: int = 4, device=None) -> QuantMatmulPlan:
    """The launch of :func:`w4a16_matmul` (``bits=8``: :func:`w8a16_matmul`) for x [m, K] and a
    weight [N, K] with ``group`` columns per scale.  On a GPU (``device`` a CUDA device: its SM
    count; otherwise an H100/H200's 132):

    * path: ``gemv`` for m <= GEMV_MAX_M (4), else ``gemm``.
    * gemv: BLOCK_M = next_pow2(m) (<= 16), BLOCK_K = 128 input columns per step (int4: 64 bytes
      of each weight row), BLOCK_N = 4096 / (BLOCK_M * BLOCK_K / 2) within [16, 64]: m = 1 -> 64
      weight rows, 2 -> 32, 3-4 -> 16 (the unrolled rows keep their loads live: <= ~110
      registers per thread on sm_90, Triton 3.6 and 3.9).
    * gemm: BLOCK_M x BLOCK_N = 16 / 32 / 64 x 64 (4 warps) for m <= 16 / 32 / 64, 64 x 128 with
      8 warps beyond; BLOCK_K = 128 for m <= 32, else 64.
    * BLOCK_K is lowered to the largest power of two dividing ``group`` when that is >= 32, so a
      step lies in one group (one scale per row: GROUP_ALIGNED); below 32 the scales are gathered
      per element.  One group per row (per-channel) is always aligned.  Never wider than K needs.
    * split_k: when the output tiles are fewer than 2 x SMs (gemv) / SMs (gemm), enough splits
      for 4 x SMs / 2 x SMs programs, each >= 256 input columns, at most 32, boundaries on
      BLOCK_K (:func:`_split`).

    Under the interpreter (a CPU): tiles of at most 32 x 64, one split unless ``split_k`` is
    given.  ``path`` / ``split_k`` force a choice."""
    op = "w4a16_plan" if bits == 4 else "w8a16_plan"
    _check_plan_args(op, m, N, K, group, path, split_k)
    interp = interpreter_active()
    path = path or ("gemv" if m <= GEMV_MAX_M else "gemm")
    p2 = triton.next_power_of_2
    if path == "gemv":
        bm, warps, bk = min(p2(m), 16), 4, 128
    else:
        bm, bn, warps = _gemm_tiles(m, interp)
        bk = 128 if (m <= 32 or interp) else 64
    if group < K and _pow2_divisor(group, bk) >= 32:
        bk = _pow2_divisor(group, bk)           # one group per step: one scale per row
    bk = max(32, min(bk, p2(K)))
    if path == "gemv":
        bn = max(16, min(64, 4096 // (bm * bk // 2)))
    if interp:
        bn = max(16, min(64, p2(N)))         # few programs: each is a Python loop iteration
    aligned = group >= K or group % bk == 0
    tiles = -(-N // bn) * -(-m // bm)
    sms = 0 if interp else _num_sms(device)          # interpreter: one split unless asked
    split_k, k_per_split = _split(tiles, K, bk, sms, path == "gemv", split_k)
    return QuantMatmulPlan(path, bm, bn, bk, split_k, k_per_split, aligned, warps)


def w8a16_plan(m: int, N: int, K: int, group: int, *, split_k: int | None = None, path: str | None = None,
               device=None) -> QuantMatmulPlan:
    """:func:`w4a16_plan` for int8 weights (the same rule)."""
    return w4a16_plan(m, N, K, group, split_k=split_k, path=path, bits=8, device=device)


def wxa8_plan(m: int, N: int, K: int, group: int, *, bits: int = 4, split_k: int | None = None,
              path: str | None = None, device=None) -> QuantMatmulPlan:
    """The launch of :func:`w4a8_matmul` (``bits=8``: :func:`w8a8_matmul`).

    * path: ``gemv`` (int32 ``tl.sum``) for m <= GEMV_MAX_M, else ``gemm`` (int8 ``tl.dot`` ->
      int32), tiles as :func:`w4a16_plan`.
    * BLOCK_K: the largest power of two dividing ``group``, at most 128 (gemv, and the int8 gemm)
      or 64 (the int4 gemm: its unpacking holds more registers); per-channel K = 704: 64.  The
      int8 dot needs BLOCK_K / 2 >= 32, so a smaller divisor becomes 64 and the last step of each
      group is masked at the group's end (int4 also needs an even group).
    * gemv: BLOCK_M = next_pow2(m), BLOCK_N = 4096 / (BLOCK_M * BLOCK_K / 2) within [16, 64].
    * split_k over whole groups, by the rule of :func:`w4a16_plan`."""
    op = f"w{bits}a8_plan"
    _check_plan_args(op, m, N, K, group, path, split_k)
    interp = interpreter_active()
    path = path or ("gemv" if m <= GEMV_MAX_M else "gemm")
    p2 = triton.next_power_of_2
    if path == "gemv":
        bk = max(2, _pow2_divisor(group, 128))
        bm, warps = min(p2(m), 16), 4
        bn = max(16, min(64, 4096 // (bm * max(bk // 2, 1))))
    else:
        bk = max(64, _pow2_divisor(group, 64 if bits == 4 else 128))
        bm, bn, warps = _gemm_tiles(m, interp)
    if interp:
        bn = max(16, min(64, p2(N)))         # few programs: each is a Python loop iteration
    tiles = -(-N // bn) * -(-m // bm)
    sms = 0 if interp else _num_sms(device)
    split_k, k_per_split = _split(tiles, K, group, sms, path == "gemv", split_k)
    return QuantMatmulPlan(path, bm, bn, bk, split_k, k_per_split, group % bk == 0 or group >= K, warps)


def w4a8_plan(m: int, N: int, K: int, group: int, **kw) -> QuantMatmulPlan:
    return wxa8_plan(m, N, K, group, bits=4, **kw)


def w8a8_plan(m: int, N: int, K: int, group: int, **kw) -> QuantMatmulPlan:
    return wxa8_plan(m, N, K, group, bits=8, **kw)


# ---- host-side checks -----------------------------------------------------------------------------

def _in_features(op: str, bits: int, qweight: torch.Tensor) -> tuple[int, int]:
    want = torch.uint8 if bits == 4 else torch.int8
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != want:
        got = qweight.dtype if isinstance(qweight, torch.Tensor) else type(qweight).__name__
        raise TypeError(f"{op}: qweight must be {want} ({'two int4 values per byte, [N, K // 2]' if bits == 4 else '[N, K]'}), "
                        f"got {got}")
    if qweight.dim() != 2:
        raise ValueError(f"{op}: qweight must be 2-D [N, {'K // 2' if bits == 4 else 'K'}], got shape {tuple(qweight.shape)}")
    if qweight.shape[1] and qweight.stride(1) != 1:
        raise ValueError(f"{op}: qweight's last dimension must be contiguous (stride 1)")
    N, kq = qweight.shape
    return N, kq * 2 if bits == 4 else kq


def _check(op: str, bits: int, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
           zeros: torch.Tensor | None, group: int, bias: torch.Tensor | None) -> tuple[int, int, int]:
    """Validate everything a wrapper gets; returns (N, K, n_groups)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in _ACT_DTYPES:
        raise TypeError(f"{op}: x must be float32, bfloat16 or float16, got "
                        f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    N, K = _in_features(op, bits, qweight)
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"{op}: x's last dimension ({x.shape[-1] if x.dim() else 'none'}) must equal the weight's "
                         f"in-features K = {K} (qweight {tuple(qweight.shape)}{', two int4 per byte' if bits == 4 else ''})")
    if K < 1 or N < 1:
        raise ValueError(f"{op}: qweight {tuple(qweight.shape)} is empty")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"{op}: group must be a positive int (input columns per scale; K for per-channel), got {group!r}")
    if group > K:
        raise ValueError(f"{op}: group {group} > K = {K} (per-channel scales: group = K)")
    n_groups = -(-K // group)
    if not isinstance(scales, torch.Tensor) or scales.dtype != torch.float32:
        raise TypeError(f"{op}: scales must be a float32 tensor, got "
                        f"{scales.dtype if isinstance(scales, torch.Tensor) else type(scales).__name__}")
    if scales.dim() != 2 or scales.shape[0] not in (1, N) or scales.shape[1] != n_groups:
        raise ValueError(f"{op}: scales must be [N={N}, K/group={n_groups}] (or [1, 1] per tensor), got "
                         f"{tuple(scales.shape)} for group {group}")
    if zeros is not None:
        if not isinstance(zeros, torch.Tensor) or zeros.dtype != torch.int8:
            raise TypeError(f"{op}: zeros must be int8 (or None: symmetric), got "
                            f"{zeros.dtype if isinstance(zeros, torch.Tensor) else type(zeros).__name__}")
        if zeros.dim() != 2 or zeros.shape[0] not in (1, N) or zeros.shape[1] != n_groups:
            raise ValueError(f"{op}: zeros must have the shape of scales [N={N}, {n_groups}] (or [1, 1]), got "
                             f"{tuple(zeros.shape)}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or not bias.is_floating_point():
            raise TypeError(f"{op}: bias must be a floating-point tensor [N={N}]")
        if bias.shape != (N,):
            raise ValueError(f"{op}: bias must be [N={N}], got {tuple(bias.shape)}")
    return N, K, n_groups


def _rows(N: int, t: torch.Tensor | None) -> torch.Tensor | None:
    """[1, g] scales / zeros (per tensor) as [N, g] with row stride 0 (no copy)."""
    return t if t is None or t.shape[0] == N else t.expand(N, -1)


def _launch_opts(plan: QuantMatmulPlan) -> dict:
    opts = {"num_warps": plan.num_warps}
    if plan.num_stages is not None:
        opts["num_stages"] = plan.num_stages
    return opts


def _reduce(ws: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    S, M, N = ws.shape
    block = 1024
    extra = {} if interpreter_active() else {"num_warps": 4}
    _split_k_reduce_kernel[(triton.cdiv(M * N, block),)](ws, ws if bias is None else bias, out, M * N, N, S,
                                                         HAS_BIAS=bias is not None, BLOCK=block, **extra)
    count_launch("split_k_reduce")


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


def _int_values(qweight: torch.Tensor, zeros: torch.Tensor | None, bits: int, group: int, K: int) -> torch.Tensor:
    """``q - z`` [N, K] as float32 (exact small integers), plain torch."""
    N = qweight.shape[0]
    if bits == 4:
        q = torch.stack([qweight & 0x0F, qweight >> 4], dim=-1).reshape(N, K).to(torch.int32)
        if zeros is None:
            return (q - 8).float()
    else:
        q = qweight.to(torch.int32)
        if zeros is None:
            return q.float()
    z = zeros.to(torch.int32).expand(N, -1).repeat_interleave(group, dim=1)[:, :K]
    return (q - z).float()


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


def weight_bytes(N: int, K: int, group: int, bits: int, zeros: bool = False) -> int:
    """Bytes of one quantized weight a call reads at least: packed values, float32 scales, int8
    zeros (benchmarks: achieved GB/s = this / time)."""
    g = -(-K // group)
    return N * K * bits // 8 + 4 * N * g + (N * g if zeros else 0)
