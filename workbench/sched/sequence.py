"""A request as the engine's scheduler tracks it.

``tokens`` holds every known token (prompt, then generated); ``num_computed`` counts those
whose KV is in the pool.  The next step computes ``tokens[num_computed:]`` (a whole prompt, a
prefill chunk, or the one token sampled last), so chunked prefill, decode, and recompute after
preemption are the same operation: catch up ``num_computed`` with ``len(tokens)``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:       # names only: the scheduler is pure Python and imports nothing of the engine
    import torch

    from workbench.engine.output import OutputProcessor
    from workbench.engine.sampling import SamplingParams
    from workbench.engine.types import RequestOutput
    from workbench.kv.block_manager import Allocation


class SeqStatus(enum.Enum):
    WAITING = "waiting"      # not admitted yet, or preempted by recompute (its KV was dropped)
    RUNNING = "running"      # holds blocks in the pool
    SWAPPED = "swapped"      # preempted by swapping: its KV waits in host memory
    HELD = "held"            # a fork (another sample of a prompt) waiting for its parent's prompt; no queue holds it
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    tokens: list[int]                 # prompt + generated so far
    prompt_len: int
    params: SamplingParams
    priority: int = 0                 # higher runs first and may preempt lower
    arrival_time: float = 0.0
    max_new: int = 16                 # generation limit (max_tokens, clipped to the context)
    status: SeqStatus = SeqStatus.WAITING
    num_computed: int = 0             # tokens whose KV is in the pool
    num_preemptions: int = 0
    seq_no: int = 0                   # arrival order, the FCFS tie-break
    wait_since: float | None = None   # when it last entered the waiting/swapped queue (None while running)
    waited_s: float = 0.0             # time spent waiting before that (aging counts only waiting time)
    prompt_logprobs_done: bool = False   # its prompt's logprobs are known (computed, or a fork's parent's):
                                         # recomputing its prompt (preemption, a released fork) needs no logits
    output: RequestOutput | None = field(default=None, repr=False)
    # the scheduler's: the allocation of its last admission, until the engine reads what it reused
    allocation: Allocation | None = field(default=None, repr=False)
    fork_of: str | None = None        # a held fork: the request whose prompt it waits for
    # the engine's: its output processor (detokenizing, stop checks), sampling generator, and, when it
    # wants logprobs, the logits row its next token is sampled from (until the token is taken)
    processor: OutputProcessor | None = field(default=None, repr=False)
    generator: torch.Generator | None = field(default=None, repr=False)
    last_row: torch.Tensor | None = field(default=None, repr=False)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def remaining(self) -> int:
        """Tokens to compute before the next token can be sampled."""
        return len(self.tokens) - self.num_computed

    @property
    def wants_prompt_logits(self) -> bool:
        """Must its prompt chunks return every row of logits (prompt logprobs not known yet)?
        Such a sequence computes its whole prompt: no prefix-cache reuse."""
        return getattr(self.params, "prompt_logprobs", None) is not None and not self.prompt_logprobs_done

    @property
    def in_prefill(self) -> bool:
        return self.num_computed < self.prompt_len

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED
