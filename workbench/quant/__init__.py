"""The quantization layer: weight and activation quantizers as transformations of the plain
model, beside ``transforms``, below ``engine``.

* ``rtn`` - round-to-nearest quantization of one weight: per tensor, per output channel or per
  group; symmetric or asymmetric; int8 and packed int4 (two per byte), and back;
* ``recipe`` - :class:`QuantRecipe`, every setting by name (W8A16 / W4A16 / W4A8 / W8A8, rtn /
  awq / gptq, SmoothQuant's alpha), with the rule for groups that do not divide a layer's input
  width (``group_fallback``) and per-layer overrides;
* ``apply`` - :func:`quantize_model` (``nn.Linear`` -> :class:`QuantLinear`, the torch reference
  of every low-bit kernel), :func:`set_quant_backend` (reference / torch CPU ops / Triton, per
  layer, with the reason for every fallback), :func:`quantization_report`, :func:`weight_bytes`;
* ``hooks`` - a learner's own asymmetric int4 scales / zero points and nibble packer run by the
  real quantizer (``quantize_model(..., group_scales=fn, pack=fn)``, notebook 05's exercises),
  every value they return checked before it becomes a layer's buffer;
* ``calib`` - what the linear layers see on calibration text (:func:`collect_linear_inputs`);
* ``fold`` - the scale groups of a decoder layer and exact folding of per-channel scales into the
  preceding norm / linear; ``smooth`` - SmoothQuant (:func:`smooth_model`); ``awq`` -
  activation-aware scale and clip search (:func:`awq_search`); ``gptq`` - Hessian-based one-shot
  rounding (:func:`gptq_quantize`);
* ``outliers`` - which input channels set the range, per layer and channel, and what each
  granularity does to them;
* ``cpu_ops`` - torch's packed int8 / int4 CPU matmuls and ``torch._int_mm`` for a QuantLinear
  (:func:`cpu_op`) and their timing (:func:`cpu_op_timing`); ``kernel_ops`` - the Triton kernels
  of ``workbench_kernels.quant_matmul`` as a backend (:func:`kernel_op`);
* ``compressed`` - quantized checkpoints in the compressed-tensors ``pack-quantized`` format that
  vLLM and transformers load (transformers checked by the tests; vLLM not run here)
  (:func:`save_compressed`, :func:`load_compressed`, :func:`is_compressed_checkpoint`), with
  ``compressed_config`` (the ``quantization_config``) and ``compressed_layout`` (the packed
  tensors, bit for bit); ``export`` - quantize a model folder
  and write such a checkpoint (:func:`quantize_checkpoint`, ``workbench quantize``);
* the calibrator (``workbench calibrate-quant``): ``quality`` (ppl / KL / top-1 / exact match paired
  with the unquantized model), ``sensitivity`` (one unit quantized at a time), ``costs`` (measured
  bytes and time per layer and option; decode steps), ``search`` (the search space, the Lagrangian
  front, a mix as one recipe), ``recommend`` (the rule: picked on the search text, confirmed on the
  confirmation text), ``calibrate`` (:func:`calibrate`, the whole run) and ``calibrate_report``
  (reasons, outputs, :func:`compare_domains`, the reproduction check); recipe files
  (:func:`save_recipe` / :func:`load_recipe`) carry a mix and the text it was measured on.

``LLM(quant="w4a16:g128:awq")`` / ``workbench generate|serve --quant ...`` use it;
``workbench quant-bench`` and notebook 05 measure it.
"""

from workbench._exports import exports, lazy

_EXPORTS = exports({
    "workbench.quant.rtn": "QuantizedWeight compute_scales encode_weight pack_int4 quantize_weight unpack_int4",
    "workbench.quant.recipe": "QuantRecipe load_recipe save_recipe",
    "workbench.quant.apply": "QuantLinear quantization_report quantize_model set_quant_backend weight_bytes",
    "workbench.quant.calib": "LinearInputs collect_linear_inputs",
    "workbench.quant.fold": "fold_scales scale_groups",
    "workbench.quant.smooth": "smooth_model",
    "workbench.quant.awq": "AWQResult awq_search",
    "workbench.quant.gptq": "GPTQResult gptq_quantize gptq_weight",
    "workbench.quant.outliers": "activation_map compare_stats range_setters recurring_channels scheme_errors "
                                "weight_map",
    "workbench.quant.cpu_ops": "cpu_op cpu_op_reason cpu_op_timing",
    "workbench.quant.kernel_ops": "kernel_op kernel_op_reason",
    "workbench.quant.compressed": "is_compressed_checkpoint load_compressed save_compressed",
    "workbench.quant.export": "quantize_checkpoint",
    "workbench.quant.calibrate": "calibrate",
    "workbench.quant.calibrate_report": "check_reported compare_domains write_outputs",
})
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
