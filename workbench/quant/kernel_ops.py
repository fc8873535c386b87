"""The Triton low-bit kernels (``workbench_kernels.quant_matmul``) as the ``triton`` backend of
a :class:`~workbench.quant.apply.QuantLinear`.

::

    op = kernel_op(qlinear)          # None when the layer's format has no kernel (kernel_op_reason says why)
    y = op(x)                         # x [.., in] in the activation dtype -> [.., out]

Which kernel a layer gets: W4A16 -> ``w4a16_matmul`` (split-K GEMV for a few rows, a tiled GEMM
otherwise), W8A16 -> ``w8a16_matmul``, W4A8 / W8A8 -> ``w4a8_matmul`` / ``w8a8_matmul`` (the
input rounded per token to int8 inside).  Per-tensor scales are expanded to one per output
channel (same numbers).  On a CPU the kernels run only under the Triton interpreter
(``TRITON_INTERPRET=1``, for tests): correct, and far slower than anything else.
"""

from __future__ import annotations

import os


def kernel_op_reason(layer) -> str | None:
    """Why ``layer`` has no Triton kernel here (None when it has one)."""
    if layer.qweight.device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        return "Triton kernels need a GPU (or TRITON_INTERPRET=1 on a CPU)"
    try:
        import workbench_kernels.quant_matmul  # noqa: F401  (lazy: Triton kernels, optional, ~0.7 s)
    except ImportError as e:                    # triton missing
        return f"Triton kernels unavailable: {e}"
    if layer.act_bits and layer.zeros is not None:
        return "int8 activations need symmetric weights"
    return None


def kernel_op(layer):
    """A function ``x -> y`` running ``layer`` through its Triton kernel, or None."""
    if kernel_op_reason(layer) is not None:
        return None
    from workbench_kernels import quant_matmul as qm

    n = layer.out_features
    scales = layer.scales if layer.scales.shape[0] == n else layer.scales.expand(n, -1).contiguous()
    zeros = layer.zeros
    if zeros is not None and zeros.shape[0] != n:
        zeros = zeros.expand(n, -1).contiguous()
    group = layer.group or layer.in_features
    w, b = layer.qweight, layer.bias
    if layer.act_bits:
        fn = qm.w4a8_matmul if layer.bits == 4 else qm.w8a8_matmul
        return lambda x: fn(x, w, scales, group, bias=b)
    fn = qm.w4a16_matmul if layer.bits == 4 else qm.w8a16_matmul
    return lambda x: fn(x, w, scales, zeros, group, bias=b)
