"""Sampling parameters and the reference sampler.

``SamplingParams`` follows vLLM's names so learners can move between the two.  The sampler is
plain torch on one row of logits: temperature -> top-k -> top-p -> a draw from a per-request
``torch.Generator`` (so a seeded request is reproducible whatever else runs).

Numerically safe for every value validation accepts: a temperature below :data:`SAMPLING_EPS`
(1e-5, vLLM's floor) is greedy - dividing logits by 1e-38 would give inf and NaN
probabilities - and top-p always keeps the most likely token, whatever ``top_p`` rounds to in
float32 (1e-46 is 0 there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workbench.errors import ConfigError

SAMPLING_EPS = 1e-5     # temperatures below this are greedy (logits / T would overflow)
MAX_LOGPROBS = 20       # top-k log-probabilities per token at most (OpenAI's limit for chat)


def token_logprobs(logits: torch.Tensor, targets: list[int], k: int) -> list[dict]:
    """Per row of ``logits`` [n, V]: the log-probability of ``targets[i]`` under the model's own
    distribution (log-softmax of the raw logits, float32: before temperature, top-k or top-p,
    as OpenAI reports them) and the ``k`` most likely tokens with theirs."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
    if k:
        top = lp.topk(k, dim=-1)
        tops = [dict(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        tops = [{} for _ in targets]
    return [{"token_id": t, "logprob": p, "top": tp} for t, p, tp in zip(targets, picked, tops)]


@dataclass
class SamplingParams:
    temperature: float = 1.0    # 0 = greedy
    top_p: float = 1.0          # nucleus: keep the smallest set of tokens with mass >= top_p
    top_k: int = 0              # keep the k most likely tokens (0 or -1 = all)
    max_tokens: int = 16
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None         # log-probabilities of each generated token, and of the top-k (0..20)
    prompt_logprobs: int | None = None  # the same for every prompt token (computed in full: no prefix-cache reuse)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks = [
            (self.temperature >= 0, "temperature", "must be >= 0 (0 means greedy)"),
            (0 < self.top_p <= 1, "top_p", "must be in (0, 1]"),
            (isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "must be an integer >= -1 (0 or -1: off)"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens", "must be an integer >= 1"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (self.logprobs is None or (isinstance(self.logprobs, int) and 0 <= self.logprobs <= MAX_LOGPROBS),
             "logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]"),
            (self.prompt_logprobs is None or (isinstance(self.prompt_logprobs, int)
                                              and 0 <= self.prompt_logprobs <= MAX_LOGPROBS),
             "prompt_logprobs", f"must be None or an integer in [0, {MAX_LOGPROBS}]"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ConfigError(f"SamplingParams.{name}={getattr(self, name)!r} {why}")
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    def generator(self, device: torch.device) -> torch.Generator | None:
        if self.greedy:
            return None
        gen = torch.Generator(device=device)
        if self.seed is not None:
            gen.manual_seed(self.seed)
        else:
            gen.seed()
        return gen


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> torch.Tensor:
    """logits [V] -> a 0-d token id tensor."""
    if params.greedy:
        return logits.argmax(-1)
    logits = logits.float() / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(descending=True)
        # drop a token when the mass *before* it already reaches top_p (the first one always stays)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        drop[..., 0] = False        # the most likely token always stays (top_p may round to 0 in float32)
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
    return torch.multinomial(probs, 1, generator=generator)[0]
