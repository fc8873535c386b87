"""The engine: one core that every layer plugs into, and its fronts.

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

from workbench._exports import lazy

_EXPORTS = {
    "LLM": "workbench.engine.llm",
    "ReferenceLoop": "workbench.engine.llm",
    "reference_generate": "workbench.engine.llm",
    "reference_scheduler": "workbench.engine.llm",
    "LLMEngine": "workbench.engine.core",
    "StepRecord": "workbench.engine.core",
    "AsyncEngine": "workbench.engine.async_engine",
    "LoadedModel": "workbench.engine.loaded",
    "SamplingParams": "workbench.engine.sampling",
    "RequestOutput": "workbench.engine.types",
    "StreamEvent": "workbench.engine.types",
    "RequestMetrics": "workbench.engine.metrics",
    "summarize": "workbench.engine.metrics",
    "ModelRunner": "workbench.engine.runners",
    "ContiguousRunner": "workbench.engine.runners",
    "StaticRunner": "workbench.engine.runners",
    "Trace": "workbench.engine.traces",
    "TraceRequest": "workbench.engine.traces",
    "ReplayResult": "workbench.engine.traces",
    "replay": "workbench.engine.traces",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
