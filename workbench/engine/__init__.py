"""The engine: one core that every layer plugs into, and its fronts.

* ``config``: :class:`EngineConfig` - one configuration (KV, scheduler, fast paths, tiers,
  quantization, weight streaming, memory, loading), every refused combination decided in one place;
* ``core``: :class:`LLMEngine` - scheduler + block accounting + runner + outputs, per-step records,
  fault isolation, parallel sampling (forks);
* ``runners``: one batched forward per step - over the paged pool, over a cache per sequence
  (contiguous or tiered), or on static decode buffers (compile / CUDA graphs);
* ``llm``: :class:`LLM`, the offline front (``LLM()`` is the reference configuration), and
  :class:`ReferenceLoop`, the bare decode loop for teaching and instruments;
* ``loaded``: a loaded model with its tokenizer, limits and thread choice;
* ``sampling``, ``output``, ``types``, ``metrics``: sampling parameters and safe sampling, stop
  conditions and detokenized deltas, stream events and outputs, per-request metrics;
* ``async_engine``: :class:`AsyncEngine`, the engine on a thread, for servers;
* ``traces``: timed traces and :func:`replay` (continuous or static batching).
"""

from workbench._exports import exports, lazy

_EXPORTS = exports({
    "workbench.engine.llm": "LLM ReferenceLoop reference_generate reference_scheduler",
    "workbench.engine.core": "LLMEngine StepRecord",
    "workbench.engine.async_engine": "AsyncEngine",
    "workbench.engine.loaded": "LoadedModel",
    "workbench.engine.sampling": "SamplingParams",
    "workbench.engine.types": "RequestOutput StreamEvent",
    "workbench.engine.metrics": "RequestMetrics summarize",
    "workbench.engine.config": "EngineConfig FastPathConfig LoadOptions QuantConfig TierSetup",
    "workbench.engine.runners": "Runner ModelRunner ContiguousRunner StaticRunner PagedStaticRunner",
    "workbench.engine.traces": "Trace TraceRequest ReplayResult replay",
})
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
