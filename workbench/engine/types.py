"""What engines return: per-token stream events and per-request outputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from workbench.engine.metrics import RequestMetrics


@dataclass
class StreamEvent:
    """One generated token as it leaves the engine."""
    request_id: str
    index: int              # 0 for the first generated token
    token_id: int
    text: str               # new text released by this token ("" while a character or stop string is pending)
    time: float             # perf_counter() when the token id reached the host
    since_arrival: float    # seconds since the request arrived
    finished: bool = False
    finish_reason: str | None = None   # "stop", "length", "abort", "rejected", "error"
    error: str | None = None           # why, for "rejected" / "error" / "abort"
    logprobs: dict | None = None       # with SamplingParams.logprobs: {"logprob", "top": {token id: logprob}}
    # with SamplingParams.prompt_logprobs, on the first token's event: the request's prompt_logprobs
    prompt_logprobs: list | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str | None = ""
    finish_reason: str | None = None   # "stop" (EOS or stop string) or "length"
    stop_reason: str | int | None = None  # the stop string or EOS id that ended it
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0            # prompt tokens served from the prefix cache (paged KV only)
    prefix_miss_reason: str | None = None  # why the prefix cache did not serve more (paged KV only)
    error: str | None = None              # why it ended, for "rejected" / "error" / "abort"
    priority: int = 0
    num_preemptions: int = 0
    # with SamplingParams.logprobs: per generated token {"token_id", "logprob", "top": {id: logprob}};
    # with prompt_logprobs: per prompt token the same (None for the first: nothing precedes it)
    logprobs: list[dict] | None = None
    prompt_logprobs: list[dict | None] | None = None
