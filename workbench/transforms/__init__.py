"""Transformations of the plain model, each switchable and checked against it.

* ``backends``: per-op backends (eager / triton / compile) for rmsnorm, rope, swiglu, attention,
  sampling, applied in place and removable;
* ``cuda_graphs``: static decode buffers and bucketed CUDA-graph capture (eager, with a message, on CPU);
* ``kernel_aot``: compiling every kernel for sm_90 / sm_80 on any machine (``workbench kernels-aot``).

Quantization (``workbench.quant``) sits beside this layer.
"""

from workbench._exports import exports, lazy

_EXPORTS = exports({
    "workbench.transforms.backends": "apply_backends remove_backends using_backends current_backends describe_backends",
    "workbench.transforms.cuda_graphs": "GraphedDecoder StaticDecodeCache",
})
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
