"""Solutions to notebook 01's exercises (workbench exercises list 01).

Triton kernels: on a CPU they run under the Triton interpreter, which needs TRITON_INTERPRET=1
set before triton is first imported (the notebook and the tests set it).
"""

import torch
import triton
import triton.language as tl


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension of x [..., N] by a Triton kernel; y has x's shape and dtype."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N).contiguous()           # rows [M, N]
    M = x2.shape[0]
    y = torch.empty_like(x2)                     # x's dtype
    if M > 0:
        BLOCK_N = triton.next_power_of_2(N)      # a whole row in one block, padded to a power of two
        _rmsnorm_kernel[(M,)](x2, weight, y, x2.stride(0), y.stride(0), N, eps, BLOCK_N=BLOCK_N)
    return y.view(x.shape)


@triton.jit
def _rmsnorm_kernel(X, W, Y, stride_x, stride_y, N, eps, BLOCK_N: tl.constexpr):
    """One program per row: y = w * (x * rsqrt(mean(x^2) + eps)), the statistics in float32."""
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N                              # the block is wider than the row when N is not a power of 2
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / N          # divide by N, not BLOCK_N: the padding is zeros
    rstd = tl.rsqrt(mean_sq + eps)
    xn = (x * rstd).to(X.dtype.element_ty)       # round to x's dtype before the weight, as the model does
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    y = xn.to(tl.float32) * w
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate, up [..., I] in one Triton kernel; y has gate's shape and dtype."""
    I = gate.shape[-1]
    g2 = gate.reshape(-1, I).contiguous()
    u2 = up.reshape(-1, I).contiguous()
    M = g2.shape[0]
    y = torch.empty_like(g2)
    if M > 0 and I > 0:
        BLOCK = 128                              # columns per program; a second grid axis tiles wide rows
        grid = (M, triton.cdiv(I, BLOCK))
        _swiglu_kernel[grid](g2, u2, y, g2.stride(0), u2.stride(0), y.stride(0), I, BLOCK=BLOCK)
    return y.view(gate.shape)


@triton.jit
def _swiglu_kernel(G, U, Y, stride_g, stride_u, stride_y, I, BLOCK: tl.constexpr):
    """y = g * sigmoid(g) * u, computed in float32 and rounded once."""
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(G + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u                    # sigmoid(g) = 1 / (1 + exp(-g)): finite for any g
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
