"""Admission: which waiting requests join the next step, as a pure function the scheduler calls.

Step 3 of :meth:`Scheduler.schedule <workbench.sched.scheduler.Scheduler.schedule>` describes the
waiting queue as plain values and asks an *admission rule* which requests join this step and how
many prompt tokens each computes now.  :func:`admit` is the package's own rule;
``SchedulerConfig(admission=fn)`` puts another in its place (notebook 04's exercise ``04.admit``).

The rule is called as ``rule(waiting=..., budget=..., scheduled_tokens=..., free_seqs=...,
free_blocks=..., chunked_prefill=...)``:

``waiting``           the waiting requests (any order), each a dict:
                      ``id`` (str), ``priority`` (its aged priority: higher first), ``cached`` (prompt
                      tokens found in the prefix cache: the longer first at equal priority; 0 when the
                      scheduler is not prefix-aware), ``arrival`` (arrival order: 0, 1, 2, ...),
                      ``tokens`` (prompt tokens it computes once admitted: the prefix-cache hit is not
                      computed) and ``blocks`` (KV blocks admitting it takes from the pool);
``budget``            the step's token budget (``max_num_batched_tokens``);
``scheduled_tokens``  tokens the running sequences already compute this step;
``free_seqs``         sequence slots left (``max_num_seqs`` minus the running sequences);
``free_blocks``       KV blocks a new request can get now (free plus evictable cached ones);
``chunked_prefill``   whether a prompt may be split across steps.

It returns ``[(request id, tokens), ...]``: the requests admitted, in the order they are admitted,
and the prompt tokens each computes in this step.  :func:`admission_problem` says what makes an
answer invalid (the scheduler refuses such an answer with a one-line
:class:`~workbench.errors.WorkbenchError`); whether a valid answer is *the package's* is the
exercise's question.

Requests that can never fit in the pool are rejected before the rule sees them, and priority
preemption stays the scheduler's: when the rule leaves out a request that does not fit, running
requests of strictly lower priority may be preempted to make room for it (module doc of
:mod:`workbench.sched.scheduler`).  Pure Python.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

#: the rule's signature: (waiting, budget, scheduled_tokens, free_seqs, free_blocks, chunked_prefill) -> admissions
AdmissionRule = Callable[..., list]
#: the keys of one waiting request
WAITING_KEYS = ("id", "priority", "cached", "arrival", "tokens", "blocks")


def order_key(request: dict) -> tuple:
    """The package's admission order: aged priority (highest first), then the longest cached
    prefix (prefix-aware), then arrival (first come, first served)."""
    return (-request["priority"], -request["cached"], request["arrival"])


def chunk_tokens(tokens: int, left: int, others: bool, chunked_prefill: bool) -> int:
    """Tokens a sequence with ``tokens`` still to compute takes from the ``left`` of the step's
    budget: all of them when they fit; else a chunk of ``left`` with chunked prefill; without it,
    none this step (it waits for a step of its own) unless nothing else (``others``) computes in
    this step: then all of them, over the budget."""
    if tokens <= left:
        return tokens
    if chunked_prefill:
        return left
    return 0 if others else tokens


def admit(waiting: list[dict], budget: int, scheduled_tokens: int, free_seqs: int, free_blocks: int,
          chunked_prefill: bool) -> list[tuple[str, int]]:
    """The package's admission rule (module doc): in :func:`order_key` order, admit each request
    while the budget has tokens left, a sequence slot is free and its blocks fit; the first that
    does not fit stops admission (no overtaking: a large request is not starved by smaller ones
    behind it).  Each admitted request computes :func:`chunk_tokens` of what is left."""
    left = budget - scheduled_tokens
    others = scheduled_tokens > 0
    out: list[tuple[str, int]] = []
    for r in sorted(waiting, key=order_key):
        if left <= 0 or free_seqs <= 0 or r["blocks"] > free_blocks:
            break
        n = chunk_tokens(r["tokens"], left, others, chunked_prefill)
        out.append((r["id"], n))
        left, free_seqs, free_blocks = left - n, free_seqs - 1, free_blocks - r["blocks"]
        others = others or n > 0
    return out


def _pairs(answer: Any) -> tuple[list[tuple[Any, Any]] | None, str | None]:
    if not isinstance(answer, (list, tuple)):
        return None, f"the rule must return a list of (request id, tokens) pairs, got {type(answer).__name__}"
    pairs = []
    for i, a in enumerate(answer):
        if not isinstance(a, (list, tuple)) or len(a) != 2:
            return None, (f"item {i} of the answer is {a!r}: each item is a (request id, tokens) pair")
        pairs.append((a[0], a[1]))
    return pairs, None


def admission_problem(answer: Any, waiting: list[dict], budget: int, scheduled_tokens: int, free_seqs: int,
                      free_blocks: int, chunked_prefill: bool) -> str | None:
    """None when ``answer`` is a valid admission for this step (whatever the policy), else the
    rule it breaks, in one line: a request that is not waiting or is admitted twice, more tokens
    than it has to compute, a split prompt without chunked prefill, more requests than free
    sequence slots, more blocks than are free, a step over its token budget."""
    pairs, why = _pairs(answer)
    if why:
        return why
    by_id = {r["id"]: r for r in waiting}
    seen: set = set()
    for rid, n in pairs:
        if rid not in by_id:
            ids = ", ".join(map(str, list(by_id)[:8])) + (", ..." if len(by_id) > 8 else "")
            return (f"{rid!r} is not a waiting request (waiting: {ids})" if by_id
                    else f"{rid!r} is admitted, but no request is waiting")
        if rid in seen:
            return f"{rid} is admitted twice"
        seen.add(rid)
        if isinstance(n, bool) or not isinstance(n, int):
            return f"{rid} computes {n!r} tokens: the number of tokens is an int"
        r = by_id[rid]
        if n < 0:
            return f"{rid} computes {n} tokens: a request computes 0 or more"
        if n > r["tokens"]:
            return f"{rid} computes {n} tokens, but it has {r['tokens']} prompt tokens to compute"
        if not chunked_prefill and 0 < n < r["tokens"]:
            return (f"{rid} computes {n} of its {r['tokens']} prompt tokens, but chunked prefill is off: a prompt is "
                    f"computed whole or not at all in a step")
    if len(pairs) > free_seqs:
        return (f"{len(pairs)} requests are admitted, but {free_seqs} sequence slot"
                f"{'' if free_seqs == 1 else 's'} {'is' if free_seqs == 1 else 'are'} free (max_num_seqs)")
    free = free_blocks
    for i, (rid, _) in enumerate(pairs):
        need = by_id[rid]["blocks"]
        if need > free:
            took = [str(p[0]) for p in pairs[:i] if by_id[p[0]]["blocks"]]
            before = f" after {', '.join(took)} took theirs" if took else ""
            return (f"{rid} needs {need} KV block{'' if need == 1 else 's'}, {free} {'is' if free == 1 else 'are'} "
                    f"free{before}")
        free -= need
    admitted = sum(n for _, n in pairs)
    total = scheduled_tokens + admitted
    if total > budget:
        computing = [rid for rid, n in pairs if n > 0]
        if not chunked_prefill and scheduled_tokens == 0 and len(computing) == 1:
            return None        # a whole prompt larger than the budget, alone: a step of its own
        return (f"the step computes {total} tokens ({scheduled_tokens} already scheduled + {admitted} admitted), "
                f"over the budget of {budget} (max_num_batched_tokens)")
    return None
