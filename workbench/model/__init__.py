"""The model layer: what a checkpoint is and how it computes.

* ``config``: :class:`ModelConfig` from a Hugging Face ``config.json`` (types and bounds checked);
* ``presets``: shapes of known models (random weights) for sizing and benchmarks;
* ``checkpoint``: the checks before anything is allocated (files, safetensors headers, sizes, NaN / Inf);
* ``loader``: :func:`load_model` / :func:`save_model` (safetensors only);
* ``tokenizer``: :class:`Tokenizer` (HF ``tokenizers``), incremental detokenization;
* ``chat_template``: the checkpoint's Jinja chat template
  (:class:`~workbench.model.chat_template.ChatTemplate`), rendered as
  transformers renders it in a bounded sandbox (``template_budget``: the limits and the meter;
  ``template_filters``, ``template_sandbox``: the filters, methods and environment, bounded);
* ``decoder``: the Llama / Qwen2 / Mistral decoder (:class:`CausalLM`); attention hands q / k / v
  to the cache;
* ``kv_cache``: the one cache interface ``cache.attend(attn, q, k, v, start)`` and the contiguous
  :class:`KVCache`, the reference every other cache is checked against.
"""

from workbench._exports import exports, lazy

_EXPORTS = exports({
    "workbench.model.config": "ModelConfig",
    "workbench.model.loader": "BUNDLED_MODEL load_model save_model",
    "workbench.model.decoder": "CausalLM init_weights",
    "workbench.model.tokenizer": "Tokenizer",
    "workbench.model.kv_cache": "KVCache",
})
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
