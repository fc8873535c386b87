"""Scheduler settings, validated on construction (every field named in the error)."""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from collections.abc import Callable

from workbench.errors import ConfigError


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 32                 # running sequences at most
    max_num_batched_tokens: int = 512      # token budget of one step (prefill + decode tokens)
    chunked_prefill: bool = True           # split long prompts across steps to fit the budget
    micro_batch_window_s: float = 0.0      # how long new arrivals may wait to be admitted together
    preemption_mode: str = "recompute"     # "recompute" (drop KV, recompute later) or "swap" (to host)
    priority_preemption: bool = True       # a waiting higher-priority request may preempt lower ones
    prefix_aware: bool = True              # admit requests with longer cached prefixes first (same priority)
    max_queue_len: int = 1024              # waiting requests beyond this are rejected on arrival
    aging_s: float | None = 5.0            # +1 effective priority per aging_s waited (bounds starvation)
    # who joins a step: None for the package's rule (workbench.sched.admission.admit), or a function with
    # its parameters (notebook 04's exercise 04.admit); an invalid answer is a one-line WorkbenchError
    admission: Callable | None = None

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"SchedulerConfig.{name}={getattr(self, name)!r} {why}")
        need(isinstance(self.max_num_seqs, int) and self.max_num_seqs >= 1, "max_num_seqs", "must be an integer >= 1")
        need(isinstance(self.max_num_batched_tokens, int) and self.max_num_batched_tokens >= 1,
             "max_num_batched_tokens", "must be an integer >= 1")
        need(self.micro_batch_window_s >= 0, "micro_batch_window_s", "must be >= 0 seconds")
        need(self.preemption_mode in ("recompute", "swap"), "preemption_mode", "must be 'recompute' or 'swap'")
        need(isinstance(self.max_queue_len, int) and self.max_queue_len >= 0, "max_queue_len",
             "must be an integer >= 0")
        need(self.aging_s is None or self.aging_s > 0, "aging_s", "must be > 0 seconds or None (no aging)")
        need(self.admission is None or _takes_rule_arguments(self.admission), "admission",
             "must be None (the package's rule) or a function (waiting, budget, scheduled_tokens, free_seqs, "
             "free_blocks, chunked_prefill) -> [(request id, tokens), ...]")


def _takes_rule_arguments(fn) -> bool:
    """Can ``fn`` be called as the scheduler calls an admission rule (by keyword)?"""
    if not callable(fn):
        return False
    try:
        inspect.signature(fn).bind(waiting=[], budget=0, scheduled_tokens=0, free_seqs=0, free_blocks=0,
                                   chunked_prefill=True)
    except TypeError:
        return False
    except ValueError:          # no signature to read (a builtin): let the call say
        return True
    return True
