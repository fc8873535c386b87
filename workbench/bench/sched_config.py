"""``sched-bench``'s settings (:class:`SchedBenchConfig`), without torch: the CLI builds its parser
from these defaults, and every ``workbench`` command builds every parser (importing
:mod:`workbench.bench.sched` there cost ~2 s of torch import before any command ran)."""

from __future__ import annotations

from dataclasses import dataclass

from workbench.errors import ConfigError


@dataclass
class SchedBenchConfig:
    streams: int = 8                     # concurrent requests in the throughput experiment
    prompt_tokens: int = 48              # short prompt length (tokens of held-out text)
    max_tokens: int = 32                 # new tokens per request
    rounds: int = 3                      # sequential/concurrent runs each (interleaved; 3+ for a verdict)
    rate: float = 6.0                    # Poisson arrivals per second (chunked-prefill and window traces)
    trace_requests: int = 24
    long_prompt_tokens: int = 640        # every long_every-th request of the trace has a long prompt
    long_every: int = 4
    token_budget: int = 64               # max_num_batched_tokens in the trace experiments
    windows_ms: tuple[float, ...] = (0.0, 5.0, 20.0)
    overhead_batch: int = 32             # running sequences in the overhead experiment
    overhead_tokens: int = 24
    seed: int = 0
    batch_invariant: bool | None = None  # the engine's default (True for float32 on a CPU)

    def __post_init__(self) -> None:
        for name in ("streams", "prompt_tokens", "max_tokens", "rounds", "trace_requests", "long_prompt_tokens",
                     "long_every", "token_budget", "overhead_batch", "overhead_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"SchedBenchConfig.{name} must be an integer >= 1, got {v!r}")
        if not self.rate > 0:
            raise ConfigError(f"SchedBenchConfig.rate must be > 0 requests/s, got {self.rate!r}")
        if not self.windows_ms or any(w < 0 for w in self.windows_ms):
            raise ConfigError(f"SchedBenchConfig.windows_ms must be a non-empty list of values >= 0, "
                              f"got {self.windows_ms!r}")
