"""The scheduler: which sequences compute how many tokens in the next step.  Pure Python.

Every step has a token budget (``max_num_batched_tokens``) shared by prefill and decode
tokens, so prompts and generations mix in one batch (continuous batching).  Per step::

    1. running sequences, highest priority first: reserve the slot of the token each one
       computes next (preempting the lowest-priority running sequence when the pool is full),
       then take min(remaining, budget) tokens (a decode token, or a prefill chunk);
    2. swapped-out sequences come back when blocks allow (before any new admission); one
       that could never fit in the pool again is ended with a reason (``rejected``);
    3. waiting requests are admitted by the admission rule (:func:`workbench.sched.admission.admit`,
       or ``SchedulerConfig.admission``), highest (aged) priority first, then longest cached
       prefix first (prefix-aware), then arrival order; a request that cannot get blocks may
       preempt running requests of strictly lower priority, but only when preempting them
       would make it fit; one that could never fit in the pool (prompt plus ``max_new``
       tokens) is rejected with a reason, before anything is preempted for it.  With a
       micro-batch window, admission opens only once the oldest waiting request has waited
       that long, so arrivals close in time are admitted (and prefilled) together.

Aging: a sequence gains +1 effective priority per ``aging_s`` spent *waiting* (in the waiting
or swapped queue, summed over all its waits); time spent running does not age it, but it keeps
the credit it earned while waiting, so a request admitted on its aged priority is not thrown
out again by the younger requests it overtook.  The aged priority is a whole number, so
requests of one priority that waited about as long tie, and the tie goes to the longest
cached prefix (prefix-aware), then to arrival order.

The scheduler reaches KV only through the :class:`~workbench.kv.interface.KVManager` protocol (the
plain block manager, or the pool's ``PoolBlocks``, which does the pool's own copies around its
calls); tensor work the decisions imply (swap copies) is listed in the :class:`SchedulerOutput`
for the runner.
Deterministic: the same calls with the same clock values give the same schedule.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from dataclasses import dataclass, field
from collections.abc import Callable

from workbench.errors import WorkbenchError
from workbench.kv.interface import AllocStatus, KVManager
from workbench.sched.admission import admission_problem, admit
from workbench.sched.config import SchedulerConfig
from workbench.sched.sequence import Sequence, SeqStatus


@dataclass
class ScheduledSeq:
    seq: Sequence
    start: int          # first position computed this step (== seq.num_computed at scheduling)
    num_tokens: int

    @property
    def samples(self) -> bool:
        """Does this chunk reach the last known token (so a new token is sampled)?"""
        return self.start + self.num_tokens == len(self.seq.tokens)

    @property
    def logit_rows(self) -> int:
        """Rows of logits the runner returns for this chunk: all of them for a prompt chunk of a
        request that wants prompt logprobs, else the last one when it samples, else none."""
        if self.seq.wants_prompt_logits and self.start < self.seq.prompt_len:
            return self.num_tokens
        return 1 if self.samples else 0


@dataclass
class SwapOut:
    seq: Sequence
    block_table: list[int]   # blocks holding its KV when it was preempted
    num_tokens: int          # positions [0, num_tokens) to save


@dataclass
class SwapIn:
    seq: Sequence
    num_cached: int          # positions already in the pool again (prefix-cache hits)
    num_tokens: int          # positions [num_cached, num_tokens) to restore


@dataclass
class SchedulerOutput:
    step: int
    now: float
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)     # by recompute
    swapped_out: list[SwapOut] = field(default_factory=list)
    swapped_in: list[SwapIn] = field(default_factory=list)
    admitted: list[Sequence] = field(default_factory=list)
    rejected: list[tuple[Sequence, str]] = field(default_factory=list)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.start < s.seq.prompt_len)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled if s.start >= s.seq.prompt_len)


class Scheduler:
    def __init__(self, config: SchedulerConfig, manager: KVManager) -> None:
        self.config, self.manager = config, manager
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []
        self.swap_sizes: dict[str, int] = {}   # swapped seq id -> tokens of KV saved
        self.step_no = 0
        self._seq_no = 0
        self.num_preemptions = 0
        self.num_rejected = 0
        self._admission_error: str | None = None   # an admission rule's invalid answer, raised next step

    # ---- requests in and out ----------------------------------------------------------------
    def add(self, seq: Sequence) -> str | None:
        """Queue a new sequence; returns a rejection reason instead when the queue is full."""
        if len(self.waiting) >= self.config.max_queue_len:
            self.num_rejected += 1
            seq.status = SeqStatus.FINISHED
            return f"queue full ({len(self.waiting)} waiting, max_queue_len={self.config.max_queue_len})"
        self._seq_no += 1
        seq.seq_no, seq.status = self._seq_no, SeqStatus.WAITING
        seq.wait_since = seq.arrival_time
        self.waiting.append(seq)
        return None

    def hold(self, seq: Sequence) -> None:
        """Number a forked sample (another sample of a queued request's prompt) on arrival, as
        :meth:`add` would, but queue it nowhere: the engine holds it until the parent's prompt is
        computed, then it is adopted (:meth:`adopt_fork`) or queued (:meth:`queue_held`).  Its
        wait counts from arrival either way, for aging."""
        self._seq_no += 1
        seq.seq_no, seq.status = self._seq_no, SeqStatus.HELD
        seq.wait_since = seq.arrival_time

    def queue_held(self, seq: Sequence) -> None:
        """A held fork joins the waiting queue and computes its prompt itself (with prefix caching
        it hits the parent's committed blocks).  No ``max_queue_len`` check: it was accepted on
        arrival, with its parent."""
        seq.status = SeqStatus.WAITING
        self.waiting.append(seq)

    def adopt_fork(self, parent: Sequence, child: Sequence, now: float) -> None:
        """A held fork starts running on its parent's KV: its block table is the parent's (shared;
        the partly filled last block is copied on the first write), its prompt counts as
        computed.  The parent must have computed exactly its prompt, and the caller checks that
        ``max_num_seqs`` leaves room."""
        self.manager.fork(parent.request_id, child.request_id)
        child.num_computed = parent.num_computed
        self._start_running(child, now)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence from whichever queue holds it and give its blocks back (a held fork
        has neither)."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
            self.manager.free(seq.request_id)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status is SeqStatus.SWAPPED:
            self.swapped.remove(seq)
            self.swap_sizes.pop(seq.request_id, None)
        seq.status = SeqStatus.FINISHED

    def commit_swap_in(self, s: SwapIn) -> None:
        """A swapped-in sequence's KV is back in the pool (the runner copied it): commit it."""
        self.manager.commit(s.seq.request_id, s.num_tokens)

    def update_from_output(self, out: SchedulerOutput, take: Callable[[ScheduledSeq], bool]) -> None:
        """What the step computed, in scheduling order: each chunk's KV is committed (``num_computed``
        moves on, full blocks become reusable); then, when the chunk sampled a token, ``take(chunk)``
        - the engine's output side: the token appended, its event, the stop checks - answers whether
        the token ended the request, and a request it ended finishes here (its blocks go back).  A
        request ``take`` ended otherwise (its sampling failed) was finished by the engine already."""
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed = s.start + s.num_tokens
            self.manager.commit(seq.request_id, seq.num_computed)
            if s.samples and take(s):
                self.finish(seq)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    # ---- ordering --------------------------------------------------------------------------
    def waited(self, seq: Sequence, now: float) -> float:
        """Seconds ``seq`` has spent waiting (queued or swapped out), over all its waits."""
        since = seq.wait_since
        return seq.waited_s + (max(0.0, now - since) if since is not None else 0.0)

    def effective_priority(self, seq: Sequence, now: float) -> int:
        """Priority plus one per whole ``aging_s`` spent waiting: waiting lifts a request above
        later arrivals of higher priority eventually, which bounds starvation.  Running does
        not age a sequence (it keeps what it earned while waiting)."""
        aging = self.config.aging_s
        return seq.priority + (math.floor(self.waited(seq, now) / aging) if aging else 0)

    def lookahead(self, k: int, now: float) -> tuple[list[Sequence], list[Sequence]]:
        """The next ``k`` waiting sequences in the order :meth:`schedule` would admit them (its
        step 3: aged priority, then the longest prefix cached now when prefix-aware, then arrival)
        and the next ``k`` swapped ones in the order they come back (step 2).  No state changes:
        what a KV prefetcher stages ahead.  The order is a prediction; whether each one fits, and
        when, is decided at scheduling time."""
        if k <= 0:
            return [], []
        order = lambda s: (-self.effective_priority(s, now), s.seq_no)  # noqa: E731
        swapped = heapq.nsmallest(k, self.swapped, key=order)
        key = order
        if self.config.prefix_aware and len(self.waiting) > 1:
            m = self.manager
            cached = {s.request_id: m.cached_prefix_tokens(s.tokens) if _reuse(s) else 0 for s in self.waiting}
            key = lambda s: (order(s)[0], -cached[s.request_id], s.seq_no)  # noqa: E731
        return heapq.nsmallest(k, self.waiting, key=key), swapped

    def _start_running(self, seq: Sequence, now: float) -> None:
        seq.waited_s = self.waited(seq, now)
        seq.wait_since = None
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)

    def _victim(self, now: float) -> Sequence:
        """The running sequence to preempt when the pool is full: the last in scheduling order
        (lowest aged priority, latest arrival)."""
        return min(self.running, key=lambda s: (self.effective_priority(s, now), -s.seq_no))

    def _victims_for(self, seq: Sequence, now: float) -> list[Sequence]:
        """Running sequences a waiting ``seq`` may preempt, first to go first: those below it in
        base *and* aged priority (so an aged request that was just admitted ahead of a younger
        high-priority one is not thrown out again)."""
        eff = self.effective_priority(seq, now)
        pool = [s for s in self.running if s.priority < seq.priority and self.effective_priority(s, now) < eff]
        return sorted(pool, key=lambda s: (self.effective_priority(s, now), s.priority, -s.seq_no))

    def _kv_tokens(self, seq: Sequence) -> int:
        """Slots ``seq`` holds at most: its prompt plus every token it may generate but the
        last (the last sampled token ends it before its KV is computed)."""
        return max(len(seq.tokens), seq.prompt_len + max(seq.max_new, 1) - 1)

    def _never_fits(self, seq: Sequence) -> str | None:
        """Why ``seq`` can never run to its end in this pool (None when it can)."""
        m = self.manager
        need = -(-self._kv_tokens(seq) // m.block_size)
        if need <= m.num_blocks:
            return None
        what = (f"{seq.prompt_len} prompt + up to {seq.max_new} new tokens" if len(seq.tokens) <= seq.prompt_len
                else f"{len(seq.tokens)} tokens so far, up to {seq.prompt_len + seq.max_new}")
        return f"needs {need} KV blocks ({what}), the KV pool has {m.num_blocks} (block size {m.block_size})"

    def _reject(self, seq: Sequence, reason: str, out: SchedulerOutput) -> None:
        self.finish(seq)                                   # out of its queue (waiting or swapped)
        self.num_rejected += 1
        out.rejected.append((seq, reason))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        seq.wait_since = out.now
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        seq.num_preemptions += 1
        self.num_preemptions += 1
        back = next((x for x in out.swapped_in if x.seq is seq), None)
        if back is not None:   # swapped in earlier in this step: cancel that; its KV is still on the host
            out.swapped_in.remove(back)
            self.swap_sizes[seq.request_id] = back.num_tokens
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
        elif self.config.preemption_mode == "swap" and seq.num_computed > 0:
            out.swapped_out.append(SwapOut(seq, self.manager.block_table(seq.request_id), seq.num_computed))
            self.swap_sizes[seq.request_id] = seq.num_computed
            seq.status = SeqStatus.SWAPPED
            self.swapped.append(seq)
        else:   # recompute: drop the KV (its committed blocks stay cached for a prefix hit later)
            seq.num_computed = 0
            seq.status = SeqStatus.WAITING
            self.waiting.append(seq)
            out.preempted.append(seq)
        self.manager.free(seq.request_id)

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        if self._admission_error is not None:      # an admission rule's bad answer of the last step
            msg, self._admission_error = self._admission_error, None
            raise WorkbenchError(msg)
        self.step_no += 1
        cfg, m = self.config, self.manager
        out = SchedulerOutput(self.step_no, now)
        budget = cfg.max_num_batched_tokens
        left = lambda: cfg.max_num_batched_tokens - sum(s.num_tokens for s in out.scheduled)  # noqa: E731
        order = lambda s: (-self.effective_priority(s, now), s.seq_no)  # noqa: E731

        # 0. without chunked prefill, a prompt larger than the budget takes a step of its own
        #    (prefill first: the running streams stall for that step - what chunking avoids)
        if not cfg.chunked_prefill:
            big = next((s for s in sorted(self.running, key=order) if s.remaining > budget), None)
            if big is not None:
                out.scheduled.append(ScheduledSeq(big, big.num_computed, big.remaining))
                return out

        # 1. running sequences: slots for their next tokens, then their share of the budget
        for seq in sorted(self.running, key=order):
            if seq.status is not SeqStatus.RUNNING:
                continue                                   # preempted earlier in this loop
            while m.num_tokens(seq.request_id) < len(seq.tokens):
                if m.append_slot(seq.request_id, seq.tokens[m.num_tokens(seq.request_id)]) is not None:
                    continue
                victim = self._victim(now)
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING or budget <= 0:
                continue
            n = self._chunk(seq, budget, bool(out.scheduled))
            if n:
                out.scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
                budget -= n

        budget = left()   # preempted sequences gave their share back
        # 2. swapped sequences that can never fit again end (not those swapped out just now: their
        #    copy to the host is still to be done); the others come back first, if nothing had to
        #    be preempted this step
        leaving = {id(s.seq) for s in out.swapped_out}
        for seq in list(self.swapped):
            reason = None if id(seq) in leaving else self._never_fits(seq)
            if reason is not None:
                self._reject(seq, reason, out)
        if not out.swapped_out and not out.preempted:
            for seq in sorted(self.swapped, key=order):
                if len(self.running) >= cfg.max_num_seqs or m.can_allocate(len(seq.tokens), seq.tokens, _reuse(seq)) \
                        is not AllocStatus.OK:
                    break
                alloc = m.allocate(seq.request_id, seq.tokens, _reuse(seq))
                saved = self.swap_sizes.pop(seq.request_id)
                self.swapped.remove(seq)
                # restore only what the prefix cache does not hold again: positions below
                # num_cached_tokens lie in shared cached blocks, never written over
                out.swapped_in.append(SwapIn(seq, min(alloc.num_cached_tokens, saved), saved))
                seq.num_computed = max(saved, alloc.num_cached_tokens)
                self._start_running(seq, now)
                n = self._chunk(seq, budget, bool(out.scheduled)) if budget > 0 else 0
                if n:
                    out.scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
                    budget -= n

        # 3. admissions, once the micro-batch window of the oldest waiting request has passed
        if self.waiting and not self.swapped and self._window_open(now):
            self._admit_waiting(now, out, left)
        return out

    # ---- step 3: admissions ------------------------------------------------------------------
    def _look(self, seq: Sequence) -> tuple[int, int, int]:
        """(prompt tokens in the prefix cache, tokens it computes once admitted, KV blocks admitting
        it takes from the available ones), as :meth:`BlockManager.allocate` would now: one prefix
        match.  Cached hits no request holds are available blocks too, so they count as taken."""
        m = self.manager
        match = m.match_prefix(seq.tokens, _reuse(seq))
        need = -(-len(seq.tokens) // m.block_size)
        return match.cached_tokens, len(seq.tokens) - match.cached_tokens, need - match.num_blocks + match.unheld

    def _admit_waiting(self, now: float, out: SchedulerOutput, left) -> None:
        """Step 3 of :meth:`schedule`.  The admission rule (``config.admission``, default
        :func:`workbench.sched.admission.admit`) sees the waiting requests that can fit in the
        pool as plain values and answers which join this step (pure: it changes nothing).  The
        requests are then walked in the package's order (aged priority, cached prefix when
        prefix-aware, arrival; fixed for the step): one that can never fit is rejected when the
        walk reaches it (while the budget lasts), one the rule admitted is allocated, and the first
        the rule left out that does not fit may preempt running requests of lower priority
        (:meth:`_make_room_by_priority`) and is admitted then.  When the state moved away from
        what the rule was shown (an admission took cached blocks another request would hit, an
        offload tier restored a prefix, a preemption freed blocks), the rule is asked again about
        the requests still waiting: every decision is taken on exact numbers, as the loop it
        replaces took them one request at a time."""
        cfg, m = self.config, self.manager
        if left() <= 0:
            return
        rule = cfg.admission or admit
        looks = {s.request_id: self._look(s) for s in self.waiting}
        cached = {rid: (c if cfg.prefix_aware else 0) for rid, (c, _, _) in looks.items()}
        prio = {s.request_id: self.effective_priority(s, now) for s in self.waiting}
        queue = sorted(self.waiting, key=lambda s: (-prio[s.request_id], -cached[s.request_id], s.seq_no))
        never = {s.request_id: self._never_fits(s) for s in queue}
        fresh = True                               # looks describe the pool as it is now
        while queue:
            if left() <= 0:
                return
            if not fresh:
                looks = {s.request_id: self._look(s) for s in queue}
            waiting = [{"id": s.request_id, "priority": prio[s.request_id], "cached": cached[s.request_id],
                        "arrival": s.seq_no, "tokens": looks[s.request_id][1], "blocks": looks[s.request_id][2]}
                       for s in queue if never[s.request_id] is None]
            shown = dict(waiting=waiting, budget=cfg.max_num_batched_tokens,
                         scheduled_tokens=sum(x.num_tokens for x in out.scheduled),
                         free_seqs=max(0, cfg.max_num_seqs - len(self.running)), free_blocks=m.num_available_blocks,
                         chunked_prefill=cfg.chunked_prefill)
            planned = self._ask(rule, shown, out)
            if planned is None:
                return
            fresh, again = True, False
            assumed_free = shown["free_blocks"]    # the blocks the rule's answer leaves, as it was shown them
            for seq in list(queue):
                if left() <= 0 and not planned:
                    return
                rid = seq.request_id
                if never[rid] is not None:
                    if left() > 0:                 # (as far as the budget lasts)
                        self._reject(seq, never[rid], out)
                        queue.remove(seq)
                    continue
                if not fresh and self._look(seq) != looks[rid]:
                    again = True                   # the rule saw other numbers for it: ask again
                    break
                if rid in planned:
                    before = m.num_cached_blocks
                    n = self._start_admitted(seq, now, out, left, planned.pop(rid), looks[rid][1])
                    queue.remove(seq)              # (refused by the pool: it stays waiting, for the next step)
                    assumed_free -= looks[rid][2]
                    if n is None or n[0] != n[1]:
                        fresh, again = False, True     # the pool or the budget is not what the rule saw
                        break
                    if m.num_cached_blocks != before or m.num_available_blocks != assumed_free:
                        fresh = False              # others' prefix hits may have moved: look again before each
                    continue
                if planned:
                    continue                       # the rule admits requests after this one: pass it over
                # the first request the rule left out, its admissions done: priority preemption
                if len(self.running) < cfg.max_num_seqs and looks[rid][2] <= m.num_available_blocks:
                    again = not fresh              # it fits: the rule left it waiting (asked again if the
                    break                          # pool moved under the answer)
                if not self._make_room_by_priority(seq, now, out):
                    return                         # first come, first served: no overtaking
                status = m.can_allocate(len(seq.tokens), seq.tokens, _reuse(seq))
                if status is not AllocStatus.OK or len(self.running) >= cfg.max_num_seqs:
                    return
                self._start_admitted(seq, now, out, left, None, None)
                queue.remove(seq)
                fresh, again = False, True
                break
            if not again:
                return

    def _ask(self, rule, shown: dict, out: SchedulerOutput) -> dict[str, int] | None:
        """The rule's answer as {request id: tokens}; None when it has none to give (it raised or
        answered something invalid: see :meth:`_refuse`)."""
        if rule is admit:                          # the package's own: trusted, not copied or validated
            return dict(admit(**shown))
        try:
            answer = rule(**{**shown, "waiting": [dict(w) for w in shown["waiting"]]})
        except Exception as e:  # noqa: BLE001 - the learner's code: said in one line
            self._refuse(f"it raised {type(e).__name__}: {e}", out)
            return None
        problem = admission_problem(answer, **shown)
        if problem is not None:
            self._refuse(problem, out)
            return None
        return {rid: n for rid, n in answer}

    def _refuse(self, problem: str, out: SchedulerOutput) -> None:
        """An admission rule's answer that cannot be carried out: a one-line WorkbenchError.
        Nothing of it is applied.  Raised now when nothing else happened in this step; otherwise
        this step goes on without its admissions (the KV copies, preemptions and rejections
        decided before it must reach the engine) and the next :meth:`schedule` raises it, before
        it changes anything.  Either way every request is still queued and every block accounted."""
        msg = (f"SchedulerConfig.admission at step {out.step}: {problem}; nothing was admitted, every request "
               "still waits")
        if not (out.admitted or out.preempted or out.swapped_out or out.swapped_in or out.rejected):
            self.step_no -= 1
            raise WorkbenchError(msg)
        self._admission_error = msg

    def _start_admitted(self, seq: Sequence, now: float, out: SchedulerOutput, left, planned: int | None,
                        shown_tokens: int | None) -> tuple[int, int] | None:
        """Allocate ``seq``'s blocks, start it and schedule its first chunk: the rule's ``planned``
        tokens (capped by what remains after the allocation: an offload tier may restore more of
        its prefix than the rule was shown), or the package's chunk rule (None: the package's own
        rule, or a request admitted after a preemption).  Returns (tokens scheduled, tokens
        planned), or None when the pool refuses the blocks (nothing changed)."""
        m = self.manager
        alloc = m.allocate(seq.request_id, seq.tokens, _reuse(seq))
        if alloc is None:
            return None
        self.waiting.remove(seq)
        seq.num_computed = alloc.num_cached_tokens
        seq.allocation = alloc
        self._start_running(seq, now)
        out.admitted.append(seq)
        if planned is None or self.config.admission is None:
            n = self._chunk(seq, left(), bool(out.scheduled))
        else:
            n = seq.remaining if planned >= shown_tokens else min(planned, seq.remaining)
        if n:
            out.scheduled.append(ScheduledSeq(seq, seq.num_computed, n))
        return n, (n if planned is None else planned)

    def _chunk(self, seq: Sequence, budget: int, others: bool) -> int:
        """Tokens of ``seq`` to compute within ``budget``: all that remain, or a prefill chunk.
        Without chunked prefill a prompt larger than the budget waits for a step of its own
        (step 0 of :meth:`schedule`)."""
        n = seq.remaining
        if n <= budget:
            return n
        if self.config.chunked_prefill:
            return budget
        return 0 if others else n

    def _window_open(self, now: float) -> bool:
        w = self.config.micro_batch_window_s
        if w <= 0:
            return True
        free_slots = self.config.max_num_seqs - len(self.running)
        oldest = min(s.arrival_time for s in self.waiting)
        return now - oldest >= w or len(self.waiting) >= free_slots

    def _make_room_by_priority(self, seq: Sequence, now: float, out: SchedulerOutput) -> bool:
        """Preempt running sequences of strictly lower priority, lowest first, until ``seq`` has
        a sequence slot and its blocks; False (and nothing preempted) when even preempting every
        one of them would not be enough."""
        cfg, m = self.config, self.manager
        if not cfg.priority_preemption:
            return False
        victims = self._victims_for(seq, now)
        slots_short = len(self.running) - cfg.max_num_seqs + 1
        match = m.match_prefix(seq.tokens, _reuse(seq))
        hit_set = set(match.block_ids)
        need = -(-len(seq.tokens) // m.block_size) - match.num_blocks
        # as BlockManager.can_allocate counts: cached hits are not available for the new blocks
        available = m.num_available_blocks - match.unheld
        refs: Counter = Counter()
        for k in range(len(victims) + 1):
            if k:
                refs.update(m.block_table(victims[k - 1].request_id))
            # blocks the first k victims release (no other holder); a released hit stays a hit
            freed = sum(1 for b, c in refs.items() if c == m.block_refs(b) and b not in hit_set)
            if k >= slots_short and need <= available + freed:
                for victim in victims[:k]:
                    self._preempt(victim, out)
                return True
        return False


def _reuse(seq: Sequence) -> bool:
    """May ``seq`` start from cached prefix blocks?  Not when it wants every prompt token's
    logits (prompt logprobs not known yet): those come only from computing the prompt."""
    return not seq.wants_prompt_logits
