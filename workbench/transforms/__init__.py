"""Transformations of the plain model, each switchable and checked against it.

* ``backends``: per-op backends (eager / triton / compile) for rmsnorm, rope, swiglu, attention,
  sampling, applied in place and removable;
* ``static_step``: what every static decode step shares (batch buckets, ``torch.compile``, CUDA-graph capture);
  ``cuda_graphs``: the step over contiguous rows (eager, with a message, on CPU); ``paged_graphs``: the step over
  the paged pool's blocks;
* ``kernel_aot`` + ``kernel_launches`` + ``kernel_compile``: recording each kernel's launches and compiling them
  for sm_90 / sm_80 on any machine (``workbench kernels-aot``).

Quantization (``workbench.quant``) sits beside this layer.
"""

from workbench._exports import exports, lazy

_EXPORTS = exports({
    "workbench.transforms.backends": "apply_backends remove_backends using_backends current_backends describe_backends",
    "workbench.transforms.cuda_graphs": "GraphedDecoder StaticDecodeCache",
})
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
