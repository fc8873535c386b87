"""Transformations of the plain model, each switchable and checked against it.

* ``backends``: per-op backends (eager / triton / compile) for rmsnorm, rope, swiglu, attention,
  sampling, applied in place and removable;
* ``cuda_graphs``: static decode buffers and bucketed CUDA-graph capture (eager, with a message, on CPU);
* ``kernel_aot``: compiling every kernel for sm_90 / sm_80 on any machine (``workbench kernels-aot``).

Quantization (``workbench.quant``) sits beside this layer.
"""

from workbench._exports import lazy

_EXPORTS = {
    "apply_backends": "workbench.transforms.backends",
    "remove_backends": "workbench.transforms.backends",
    "using_backends": "workbench.transforms.backends",
    "current_backends": "workbench.transforms.backends",
    "describe_backends": "workbench.transforms.backends",
    "GraphedDecoder": "workbench.transforms.cuda_graphs",
    "StaticDecodeCache": "workbench.transforms.cuda_graphs",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
