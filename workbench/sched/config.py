"""Scheduler settings, validated on construction (every field named in the error)."""

from __future__ import annotations

from dataclasses import dataclass

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
