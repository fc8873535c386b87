"""Forks (``LLMEngine.add_request(..., fork_of=parent)``, parallel sampling): more samples of
one prompt, the prompt computed once.

On the paged pool a fork is held (:attr:`Forks.held`: parent id -> its held forks) until the step
that samples its parent's first token; it samples its own first token from the same logits row
and then runs on the parent's prompt blocks (shared; copy-on-write on the partly filled last
one).  Whenever that cannot happen (no room in ``max_num_seqs``, the parent ends or is
preempted first, the fork wants prompt logprobs the parent does not compute) it is released
into the waiting queue and computes its prompt itself - a released fork that wants the
parent's prompt logprobs gets a copy of them and rebuilds only KV (a prefix-cache hit), so
``n`` samples of a prompt with prompt logprobs cost one prompt's logits, not ``n``.  Per-sequence
KV (contiguous, tiered) has nothing to share: forks queue as any request.

One :class:`Forks` per engine holds them; it calls the scheduler's public methods and three
callables the engine gives it (sample rows, end a request with a reason, finish a request that
ended on its token) - it reads nothing else of the engine.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

from workbench.engine.step_sampling import take_token
from workbench.engine.types import StreamEvent
from workbench.errors import ConfigError
from workbench.sched.scheduler import Scheduler
from workbench.sched.sequence import Sequence, SeqStatus


class Forks:
    """The forks held for their parents' prompts (parent id -> its held forks, in arrival order).

    Three bound methods of the engine: ``sample(seqs, rows)``: a token per sequence and the errors
    of those whose sampling failed (the engine's step sampling); ``end(seq, finish, error)``: end a
    request with a reason; ``done(seq)``: a request ended on the token it just took (stop, length)."""

    def __init__(self, scheduler: Scheduler, sample: Callable, end: Callable, done: Callable) -> None:
        # the engine's bound methods, held weakly: the engine owns this object, and strong references back
        # would make a cycle that keeps the engine and its KV pool alive after it is dropped, until Python's
        # cyclic collector runs (on a GPU: the pool's memory held between engines)
        self.scheduler = scheduler
        self._sample_ref, self._end_ref, self._done_ref = map(weakref.WeakMethod, (sample, end, done))
        self.held: dict[str, list[Sequence]] = {}

    def _sample(self, seqs, rows):
        return self._sample_ref()(seqs, rows)

    def _end(self, seq: Sequence, finish: str, error: str | None) -> None:
        self._end_ref()(seq, finish, error)

    def _done(self, seq: Sequence) -> None:
        self._done_ref()(seq)

    def __contains__(self, parent_id: str) -> bool:
        """Are forks held for ``parent_id``?"""
        return parent_id in self.held

    def __bool__(self) -> bool:
        return bool(self.held)

    @property
    def num_held(self) -> int:
        return sum(map(len, self.held.values()))

    def parent(self, seqs: dict[str, Sequence], rid: str, fork_of: str, ids: list[int]) -> Sequence:
        """The request a fork shares its prompt with (a held fork's own parent when ``fork_of``
        names a held fork), or ConfigError saying why it cannot be forked."""
        parent = seqs.get(fork_of)
        if parent is not None and parent.status is SeqStatus.HELD:
            parent = seqs[parent.fork_of]
        if parent is None or parent.finished:
            raise ConfigError(f"request {rid!r}: fork_of={fork_of!r} names no unfinished request; submit the "
                              "first sample before the samples that fork it")
        if parent.tokens[:parent.prompt_len] != ids:
            raise ConfigError(f"request {rid!r} cannot fork {fork_of!r}: their prompts differ ({len(ids)} vs "
                              f"{parent.prompt_len} tokens); a fork is another sample of the same prompt")
        if parent.num_generated:
            raise ConfigError(f"request {rid!r} cannot fork {fork_of!r}: it has computed its prompt already (its "
                              "first token is sampled); forks are submitted with their parent, before it runs")
        return parent

    def hold(self, child: Sequence, parent: Sequence) -> None:
        """Hold ``child`` until ``parent``'s prompt is computed (see :meth:`start`)."""
        self.scheduler.hold(child)
        child.fork_of = parent.request_id
        self.held.setdefault(parent.request_id, []).append(child)

    def unhold(self, child: Sequence) -> None:
        """Take a held fork off its parent's list (it is adopted, released or ended)."""
        parent_id, child.fork_of = child.fork_of, None
        held = self.held[parent_id]
        held.remove(child)
        if not held:
            del self.held[parent_id]

    def release(self, parent: Sequence) -> None:
        """The forks held for ``parent`` will not share its prompt (it ended or was preempted
        first): they join the waiting queue and compute their prompt themselves."""
        for child in list(self.held.get(parent.request_id, ())):
            self.unhold(child)
            self.scheduler.queue_held(child)

    def start(self, parent: Sequence, row: torch.Tensor, t1: float, now: float, events: list[StreamEvent]) -> int:
        """The step sampled ``parent``'s first token from ``row`` (its last prompt position): each
        fork held for it samples its own first token from the same row and runs on the parent's
        blocks, as many as ``max_num_seqs`` leaves room for; the others are released to the
        waiting queue before they draw anything (so a seeded one computes what it would have
        alone).  Returns how many forks finished with their first token."""
        sched = self.scheduler
        held = list(self.held[parent.request_id])
        room = max(0, sched.config.max_num_seqs - len(sched.running))
        for child in held[room:]:
            self.unhold(child)
            if child.params.prompt_logprobs is not None:   # the parent's, known now: its prompt is only KV to
                give_prompt_logprobs(child, parent)         # rebuild (a prefix-cache hit), not every row's logits
            sched.queue_held(child)
        forks = held[:room]
        if not forks:
            return 0
        tokens, errors = self._sample(forks, row.repeat(len(forks), 1))
        finished = 0
        for child, token in zip(forks, tokens):
            if token is None:
                self._end(child, "error", errors[child.request_id])
                finished += 1
                continue
            self.unhold(child)
            sched.adopt_fork(parent, child, now)
            out = child.output
            out.num_cached_tokens = child.prompt_len
            out.metrics.first_scheduled_time = t1
            if child.params.prompt_logprobs is not None:   # the same k as the parent's (else it was not held)
                give_prompt_logprobs(child, parent)
            if take_token(child, token, row, now, events):
                self._done(child)
                finished += 1
        return finished


def give_prompt_logprobs(child: Sequence, parent: Sequence) -> None:
    """A held fork wants the same prompt logprobs as its parent, whose prompt is computed: a copy of
    the parent's entries (each its own dicts, so that changing one request's output leaves the
    others alone; ~20x faster than ``copy.deepcopy`` at 1,000 entries of top-20)."""
    child.output.prompt_logprobs = [None if e is None else {**e, "top": dict(e["top"])}
                                    for e in parent.output.prompt_logprobs]
    child.prompt_logprobs_done = True


