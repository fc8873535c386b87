"""Scheduling, pure Python (no torch): which sequences compute how many tokens in the next step.

* ``sequence``: a request as the engine tracks it (``tokens``, ``num_computed``);
* ``config``: :class:`SchedulerConfig` (token budget, chunked prefill, micro-batch window,
  priorities, preemption mode, admission limits);
* ``scheduler``: :class:`Scheduler`, continuous batching over the paged blocks of ``workbench.kv``;
* ``admission``: :func:`~workbench.sched.admission.admit`, the rule that picks who joins a step, as
  a pure function (``SchedulerConfig(admission=...)`` puts another in its place).

The engine that runs the schedule is :class:`workbench.engine.LLMEngine`.
"""

from workbench.sched.config import SchedulerConfig
from workbench.sched.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from workbench.sched.sequence import SeqStatus, Sequence

__all__ = ["SchedulerConfig", "Scheduler", "SchedulerOutput", "ScheduledSeq", "Sequence", "SeqStatus"]
