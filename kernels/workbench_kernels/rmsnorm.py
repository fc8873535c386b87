"""RMSNorm, and RMSNorm fused with the residual add that precedes it.

Math (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization")::

    y = w * x / sqrt(mean(x^2) + eps)                         per row of N elements

Reference semantics (``workbench.model.decoder.RMSNorm``, as Hugging Face's Llama): the statistics in
float32, the normalised row rounded to the input dtype *before* the weight multiply::

    y = weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)

The fused residual form is what a decoder layer does between its two halves::

    h = x + residual              (rounded to the dtype, as torch's x + residual)
    y = rmsnorm(h)                returns (y, h): h is the residual stream for the next add

Bytes (M rows of N, e bytes per element; the N-element weight is negligible)::

    fused kernel          read x, write y                                   2 e M N
    fused + residual      read x and r, write y and h                       4 e M N
    eager torch, fp32     pow, mean, mul, mul: 4 reads + 3 writes of MN     28 M N   (3.5x)
    eager torch, bf16     float(), pow, mean, mul, to(), mul                36 M N   (9x)
    eager + residual      + one add (2 reads, 1 write of e M N)

so the fused kernel should approach copy bandwidth, and eager be ~3.5x (fp32) to ~9x (bf16)
slower where the row count is large enough to be bandwidth-bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import check_device, count_launch, interpreter_active, rows_per_program

MAX_N = 1 << 16   # a whole row sits in one program's registers


@triton.jit
def _rmsnorm_fwd_kernel(
    X,                  # *in  [M, N] rows to normalise (with HAS_RESIDUAL: the block output to add)
    R,                  # *in  [M, N] residual stream (read only when HAS_RESIDUAL)
    W,                  # *in  [N] weight
    Y,                  # *out [M, N] normalised rows, dtype = promote(x, w)
    H,                  # *out [M, N] new residual x + r (written only when HAS_RESIDUAL)
    stride_x, stride_r, stride_y, stride_h,   # row strides in elements; columns are contiguous
    M, N,               # rows, row length (hidden size)
    eps,                # added to mean(x^2)
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_M: tl.constexpr,   # rows per program
    BLOCK_N: tl.constexpr,   # power of two >= N: the whole row is loaded at once
):
    """y = w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), statistics in fp32 (reference:
    ``rmsnorm_ref``); with HAS_RESIDUAL first h = (x + r).to(x.dtype), stored, and normalised."""
    pid = tl.program_id(0)
    rows = (pid * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)   # int64: M * stride may pass 2^31
    cols = tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)   # rounded like torch's add
        tl.store(H + rows[:, None] * stride_h + cols[None, :], x, mask=mask)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / N + eps)                     # [BLOCK_M]
    xn = (xf * rstd[:, None]).to(X.dtype.element_ty)                       # round before the weight
    w = tl.load(W + cols, mask=cols < N, other=0.0)
    y = xn.to(tl.float32) * w.to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def _check(op: str, x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None = None) -> None:
    if not x.is_floating_point():
        raise TypeError(f"{op}: x must be a floating-point tensor, got {x.dtype}")
    if not (x.dim() >= 1 and x.shape[-1] >= 1):
        raise ValueError(f"{op}: x must be [..., N] with N >= 1, got {tuple(x.shape)}")
    N = x.shape[-1]
    if not (weight.dim() == 1 and weight.shape[0] == N):
        raise ValueError(f"{op}: x has hidden size {N} but weight has shape {tuple(weight.shape)} (expected ({N},))")
    if not weight.is_contiguous():
        raise ValueError(f"{op}: weight must be contiguous")
    if x.stride(-1) != 1:
        raise ValueError(f"{op}: x's last dimension must be contiguous (stride 1), got stride {x.stride(-1)}")
    if N > MAX_N:
        raise ValueError(f"{op}: hidden size {N} > {MAX_N}: a row must fit one program")
    if residual is not None:
        if residual.shape != x.shape:
            raise ValueError(f"{op}: residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
        if residual.dtype != x.dtype:
            raise TypeError(f"{op}: residual dtype {residual.dtype} != x dtype {x.dtype}")
        if residual.stride(-1) != 1:
            raise ValueError(f"{op}: residual's last dimension must be contiguous")
    check_device(_rmsnorm_fwd_kernel, *(t for t in (x, weight, residual) if t is not None), op=op)


def _launch(x, weight, eps, residual):
    N = x.shape[-1]
    x2 = x.reshape(-1, N)                                  # a view whenever rows are evenly strided
    r2 = residual.reshape(-1, N) if residual is not None else x2
    M = x2.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=torch.promote_types(x.dtype, weight.dtype))
    h = torch.empty_like(x2, memory_format=torch.contiguous_format) if residual is not None else y
    if M:
        interp = interpreter_active()
        BLOCK_N = triton.next_power_of_2(N)
        BLOCK_M = rows_per_program(M, BLOCK_N, interp)
        # enough threads to cover the tile, but no more than give each thread one 16-byte load:
        # a 256-column bf16 row on 4 warps would leave each thread 2 elements (scalar loads)
        per_load = 16 // x.element_size()
        warps = min(8 if BLOCK_M * BLOCK_N >= 4096 else 4, max(1, BLOCK_M * BLOCK_N // (32 * per_load)))
        extra = {} if interp else {"num_warps": warps}
        _rmsnorm_fwd_kernel[(triton.cdiv(M, BLOCK_M),)](
            x2, r2, weight, y, h, x2.stride(0), r2.stride(0), y.stride(0), h.stride(0), M, N, float(eps),
            HAS_RESIDUAL=residual is not None, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, **extra)
        count_launch("add_rmsnorm" if residual is not None else "rmsnorm")
    shape = x.shape
    return y.view(shape), (h.view(shape) if residual is not None else None)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [..., N]; returns a new [..., N] tensor."""
    _check("rmsnorm", x, weight)
    return _launch(x, weight, eps, None)[0]


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual; return rmsnorm(h), h`` in one pass (two reads, two writes)."""
    _check("add_rmsnorm", x, weight, residual)
    return _launch(x, weight, eps, residual)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The reference: exactly ``workbench.model.decoder.RMSNorm.forward``."""
    dtype = x.dtype
    xf = x.float()                                                # read e MN, write 4 MN
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # pow r4 w4, mean r4, mul r4 w4
    return weight * xf.to(dtype)                                  # to() r4 we, mul re we


def add_rmsnorm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference of the fused form: the decoder layer's ``h = x + r`` then its norm."""
    h = residual + x                                              # read 2e MN, write e MN
    return rmsnorm_ref(h, weight, eps), h
