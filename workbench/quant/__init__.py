"""The quantization layer: weight (and later activation) quantizers as transformations of the
plain model, beside ``transforms``, below ``engine``.

* ``rtn`` - round-to-nearest quantization of one weight: per tensor, per output channel or per
  group; symmetric or asymmetric; int8 and packed int4 (two per byte), and back;
* ``recipe`` - :class:`QuantRecipe`, every setting by name, with the rule for groups that do not
  divide a layer's input width (``group_fallback``) and per-layer overrides;
* ``apply`` - :func:`quantize_model` (``nn.Linear`` -> :class:`QuantLinear`, the torch reference
  of every low-bit kernel), :func:`quantization_report`, :func:`weight_bytes`;
* ``cpu_ops`` - torch's packed int8 / int4 CPU matmuls for a QuantLinear (:func:`cpu_op`, equal
  to the reference up to float32 rounding) and their timing against dense fp32
  (:func:`cpu_op_timing`).

``LLM(quant="w4a16:g128")`` / ``workbench generate|serve --quant ...`` use it.  Still to come
(the open issue "Quantization layer"): AWQ, GPTQ, W4A8 / W8A8 with SmoothQuant, the Triton
kernels, the CPU ops as an engine backend, outlier views and notebook 05.
"""

from workbench._exports import exports, lazy

_EXPORTS = exports({
    "workbench.quant.rtn": "QuantizedWeight pack_int4 quantize_weight unpack_int4",
    "workbench.quant.recipe": "QuantRecipe",
    "workbench.quant.apply": "QuantLinear quantization_report quantize_model weight_bytes",
    "workbench.quant.cpu_ops": "cpu_op cpu_op_reason cpu_op_timing",
})
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
