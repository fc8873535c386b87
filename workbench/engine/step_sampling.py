"""One step's sampling: the runner's logits rows split per sequence (prompt logprobs taken on
the way), then one token per sampling sequence - eager (one argmax for all greedy rows, the
reference sampler per other row) or one launch of the ``sampling`` op's kernel backend.

A failure belongs to its request: :func:`sample_batch` returns the tokens of the rows that
sampled and, for the others, why they failed; :class:`~workbench.engine.core.LLMEngine` ends
those requests alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from workbench.engine.modes import describe_error
from workbench.engine.sampling import token_logprobs
from workbench.sched.sequence import Sequence


def split_logits(scheduled, logits: torch.Tensor) -> torch.Tensor:
    """The runner's rows (``ScheduledSeq.logit_rows`` per sequence, in order) -> the rows that
    sample, [k, V]; prompt-logprob rows are turned into ``output.prompt_logprobs`` here, and
    the row of a sequence that wants logprobs of its token is kept for after sampling."""
    off, sample_rows = 0, []
    for s in scheduled:
        k = s.logit_rows
        chunk = logits[off:off + k]
        off += k
        seq = s.seq
        n_prompt = seq.prompt_len
        if k and seq.wants_prompt_logits and s.start < n_prompt:
            pos = [s.start + j for j in range(k) if s.start + j + 1 < n_prompt]   # row j predicts token p + 1
            if pos:
                entries = token_logprobs(chunk[:len(pos)], [seq.tokens[p + 1] for p in pos],
                                         seq.params.prompt_logprobs)
                lst = seq.output.prompt_logprobs
                for p, e in zip(pos, entries):
                    lst[p + 1] = e
            if s.start + k >= n_prompt:        # the prompt's last chunk: a recompute needs no logits again
                seq.prompt_logprobs_done = True
        if s.samples:
            sample_rows.append(chunk[-1])
            if seq.params.logprobs is not None:
                seq.last_row = chunk[-1]
    if off != logits.shape[0]:
        raise RuntimeError(f"runner returned {logits.shape[0]} rows of logits, the step wants {off}")
    return torch.stack(sample_rows) if sample_rows else logits[:0]


def sample_batch(model, seqs: list[Sequence], logits: torch.Tensor,
                 sampler: Callable) -> tuple[list[int | None], dict[str, str]]:
    """One token per sequence, and the sequences whose sampling failed (id -> why; their
    token is None): a failure belongs to its request, the others keep their tokens.  All
    greedy rows go in one argmax (one device sync); ``sampler(row, params, generator)`` draws
    each other row (:func:`workbench.engine.sampling.sample`).  With the ``sampling`` op of
    ``model`` on a kernel backend (``--backend sampling=triton``), one launch for the whole
    batch, each sampled row drawing its noise from its own request's generator (a failed
    launch is retried row by row, so that only the failing rows fail)."""
    ops = getattr(model, "ops", None)      # the model's backend entry points (workbench.model.ops.Ops); None: reference
    kernel = ops is not None and ops.uses_kernel("sampling")
    tokens: list[int | None] = [None] * len(seqs)
    errors: dict[str, str] = {}
    if kernel:
        try:
            return sample_kernel(ops, seqs, logits), errors
        except Exception:  # noqa: BLE001 - find the rows that fail
            rows = list(range(len(seqs)))
    else:
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if greedy:
            for i, t in zip(greedy, logits[greedy].argmax(-1).tolist()):
                tokens[i] = t
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
    for i in rows:
        s = seqs[i]
        try:
            if kernel:
                tokens[i] = sample_kernel(ops, [s], logits[i:i + 1])[0]
            else:
                tokens[i] = int(sampler(logits[i], s.params, s.generator))
        except Exception as e:  # noqa: BLE001
            errors[s.request_id] = f"sampling failed: {describe_error(e)}"
    return tokens, errors


def sample_kernel(ops, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
    """One launch of the ``sampling`` op's ``greedy_tokens`` / ``sample_tokens`` for ``seqs``."""
    from workbench_kernels.sampling import gumbel_noise

    x = logits.float()
    if all(s.params.greedy for s in seqs):
        return ops.greedy_tokens(x).tolist()
    V = x.shape[1]
    noise = torch.cat([torch.zeros(1, V, device=x.device) if s.params.greedy
                       else gumbel_noise(1, V, s.generator, x.device) for s in seqs])
    return ops.sample_tokens(x, temperature=[0.0 if s.params.greedy else s.params.temperature for s in seqs],
                             top_k=[s.params.top_k for s in seqs], top_p=[s.params.top_p for s in seqs],
                             gumbel=noise).tolist()


def take_token(seq: Sequence, token: int, row: torch.Tensor | None, now: float, events: list) -> bool:
    """Give ``seq`` its sampled ``token``: its stream event (with the token's log-probability
    from logits ``row`` when asked) goes to ``events``; True when the token ends the request."""
    seq.tokens.append(token)
    ev = seq.processor.push(token, now)
    if seq.params.logprobs is not None:      # the model's log-probability of the token it chose
        ev.logprobs = token_logprobs(row[None], [token], seq.params.logprobs)[0]
        seq.output.logprobs.append(ev.logprobs)
    seq.output.num_preemptions = seq.num_preemptions
    events.append(ev)
    return ev.finished
