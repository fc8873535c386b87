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

Modules (this one is the entry point: it re-exports every public name, and the kernels, which
``workbench.transforms.kernel_aot`` records and compiles as the file ``quant_matmul``):

* :mod:`~workbench_kernels.quant_wxa16` - W4A16 / W8A16: ``_wxa16_gemv_kernel``,
  ``_wxa16_gemm_kernel``, ``w4a16_matmul`` / ``w8a16_matmul`` and their references;
* :mod:`~workbench_kernels.quant_wxa8` - ``quantize_per_token_int8`` and W4A8 / W8A8
  (``_wxa8_matmul_fwd_kernel``, ``w4a8_matmul`` / ``w8a8_matmul``) and their references;
* :mod:`~workbench_kernels.quant_plan` - :class:`QuantMatmulPlan` and the ``*_plan`` functions;
* :mod:`~workbench_kernels.quant_shared` - device helpers, ``_split_k_reduce_kernel``, host
  checks, ``weight_bytes``.
"""

from __future__ import annotations

from .quant_plan import (
    GEMV_MAX_M,
    QuantMatmulPlan,
    w4a8_plan,
    w4a16_plan,
    w8a8_plan,
    w8a16_plan,
    wxa8_plan,
)
from .quant_shared import _split_k_reduce_kernel, weight_bytes  # noqa: F401  (the kernel: see above)
from .quant_wxa8 import (  # noqa: F401
    XS_FLOOR,
    _quantize_per_token_int8_fwd_kernel,
    _wxa8_matmul_fwd_kernel,
    quantize_per_token_int8,
    quantize_per_token_int8_ref,
    w4a8_matmul,
    w4a8_matmul_ref,
    w8a8_matmul,
    w8a8_matmul_ref,
)
from .quant_wxa16 import (  # noqa: F401
    _wxa16_gemm_kernel,
    _wxa16_gemv_kernel,
    w4a16_matmul,
    w4a16_matmul_ref,
    w8a16_matmul,
    w8a16_matmul_ref,
)

__all__ = ["GEMV_MAX_M", "XS_FLOOR", "QuantMatmulPlan", "quantize_per_token_int8", "quantize_per_token_int8_ref",
           "w4a8_matmul", "w4a8_matmul_ref", "w4a8_plan", "w4a16_matmul", "w4a16_matmul_ref", "w4a16_plan",
           "w8a8_matmul", "w8a8_matmul_ref", "w8a8_plan", "w8a16_matmul", "w8a16_matmul_ref", "w8a16_plan",
           "weight_bytes", "wxa8_plan"]
