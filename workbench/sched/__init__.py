"""Serving-side scheduling: continuous batching over the paged KV pool.

* ``sequence``: a request as the engine tracks it (``tokens``, ``num_computed``);
* ``config``: :class:`SchedulerConfig` (token budget, chunked prefill, micro-batch window,
  priorities, preemption mode, admission limits);
* ``scheduler``: :class:`Scheduler`, pure Python: which sequences compute how many tokens;
* ``model_runner``: :class:`ModelRunner`, one batched forward per step over the paged pool;
* ``engine``: :class:`LLMEngine`, the step loop, per-step records and request outputs;
* ``async_engine``: :class:`AsyncEngine`, the engine on a background thread for servers.
"""

from .async_engine import AsyncEngine
from .config import SchedulerConfig
from .engine import LLMEngine, StepRecord
from .model_runner import ModelRunner
from .scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from .sequence import Sequence, SeqStatus

__all__ = ["AsyncEngine", "SchedulerConfig", "LLMEngine", "StepRecord", "ModelRunner", "Scheduler", "SchedulerOutput",
           "ScheduledSeq", "Sequence", "SeqStatus"]
