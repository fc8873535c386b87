"""Serving-side scheduling: continuous batching over the paged KV pool.

* ``sequence``: a request as the engine tracks it (``tokens``, ``num_computed``);
* ``config``: :class:`SchedulerConfig` (token budget, chunked prefill, micro-batch window,
  priorities, preemption mode, admission limits);
* ``scheduler``: :class:`Scheduler`, pure Python: which sequences compute how many tokens;
* ``model_runner``: :class:`ModelRunner`, one batched forward per step over the paged pool;
* ``engine``: :class:`LLMEngine`, the step loop, per-step records and request outputs;
* ``async_engine``: :class:`AsyncEngine`, the engine on a background thread for servers;
* ``replay``: :class:`Trace` (timed requests) and :func:`replay` (real-time, continuous or static
  batching), for what-if comparisons of configurations on the same load;
* ``bench``: ``workbench sched-bench`` (throughput, chunked prefill, window, overhead).
"""

from .async_engine import AsyncEngine
from .config import SchedulerConfig
from .engine import LLMEngine, StepRecord
from .model_runner import ModelRunner
from .replay import ReplayResult, Trace, TraceRequest, replay
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .sequence import Sequence, SeqStatus

__all__ = ["AsyncEngine", "SchedulerConfig", "LLMEngine", "StepRecord", "ModelRunner", "Scheduler", "SchedulerOutput",
           "ScheduledSeq", "Sequence", "SeqStatus", "ReplayResult", "Trace", "TraceRequest", "replay"]
