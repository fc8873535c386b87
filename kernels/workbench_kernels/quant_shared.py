"""What the low-bit matmuls of :mod:`workbench_kernels.quant_matmul` share: the device helpers
that load packed integer weights and x and store a tile, the deterministic split-K reduction
(``_split_k_reduce_kernel``), the host-side argument checks, and the plain-torch integer values
the references and the benchmark start from (storage and math: see ``quant_matmul``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import count_launch, interpreter_active

_ACT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


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



# ---- split-K reduction ---------------------------------------------------------------------------

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


# ---- host-side checks -----------------------------------------------------------------------------

def _in_features(op: str, bits: int, qweight: torch.Tensor) -> tuple[int, int]:
    want = torch.uint8 if bits == 4 else torch.int8
    if not isinstance(qweight, torch.Tensor) or qweight.dtype != want:
        got = qweight.dtype if isinstance(qweight, torch.Tensor) else type(qweight).__name__
        raise TypeError(f"{op}: qweight must be {want} "
                        f"({'two int4 values per byte, [N, K // 2]' if bits == 4 else '[N, K]'}), got {got}")
    if qweight.dim() != 2:
        raise ValueError(f"{op}: qweight must be 2-D [N, {'K // 2' if bits == 4 else 'K'}], "
                         f"got shape {tuple(qweight.shape)}")
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
                         f"in-features K = {K} (qweight "
                         f"{tuple(qweight.shape)}{', two int4 per byte' if bits == 4 else ''})")
    if K < 1 or N < 1:
        raise ValueError(f"{op}: qweight {tuple(qweight.shape)} is empty")
    if isinstance(group, bool) or not isinstance(group, int) or group < 1:
        raise ValueError(f"{op}: group must be a positive int (input columns per scale; K for per-channel), "
                         f"got {group!r}")
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



def _reduce(ws: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    S, M, N = ws.shape
    block = 1024
    extra = {} if interpreter_active() else {"num_warps": 4}
    _split_k_reduce_kernel[(triton.cdiv(M * N, block),)](ws, ws if bias is None else bias, out, M * N, N, S,
                                                         HAS_BIAS=bias is not None, BLOCK=block, **extra)
    count_launch("split_k_reduce")



# ---- plain-torch integer values -------------------------------------------------------------------

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




def weight_bytes(N: int, K: int, group: int, bits: int, zeros: bool = False) -> int:
    """Bytes of one quantized weight a call reads at least: packed values, float32 scales, int8
    zeros (benchmarks: achieved GB/s = this / time)."""
    g = -(-K // group)
    return N * K * bits // 8 + 4 * N * g + (N * g if zeros else 0)
