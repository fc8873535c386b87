"""The batched engine: continuous batching over the paged KV pool.

::

    eng = LLMEngine(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=32))   # all at once
    # or drive it: requests join and leave at every step
    rid = eng.add_request("The list type", params, priority=1)
    while eng.has_unfinished():
        for ev in eng.step(): ...                  # StreamEvents, as the reference engine yields
    eng.step_records                               # per step: batch, tokens, scheduler vs model time

One :meth:`step` = schedule (pure Python) → swap copies → one batched forward → sampling →
stop checks.  Every request ends with output or an explicit reason ("rejected", "abort",
"error"), and its blocks go back to the pool.  The scheduler decides; :class:`ModelRunner`
does the tensor work; both can be replaced (a fake runner drives the property tests).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import asdict, dataclass

import torch

from ..engine import LLM
from ..engine_types import RequestOutput, StreamEvent
from ..errors import ConfigError
from ..kv.paged import PagedKVConfig, PagedKVPool
from ..metrics import RequestMetrics
from ..output import OutputProcessor
from ..sampling import SamplingParams, sample
from .config import SchedulerConfig
from .model_runner import ModelRunner
from .scheduler import Scheduler
from .sequence import Sequence


@dataclass
class StepRecord:
    step: int
    start: float                 # clock at the start of the step
    schedule_s: float            # time in Scheduler.schedule (pure Python)
    model_s: float               # swaps + forward + sampling (waits for the device)
    post_s: float                # detokenization, stop checks, bookkeeping after sampling
    num_seqs: int                # sequences computed this step
    prefill_tokens: int
    decode_tokens: int
    running: int                 # after the step
    waiting: int
    swapped: int
    kv_used_blocks: int
    admitted: int = 0
    preempted: int = 0
    swapped_out: int = 0
    swapped_in: int = 0
    rejected: int = 0
    finished: int = 0
    request_ids: tuple = ()      # the requests computed this step, in batch order
    request_tokens: tuple = ()   # tokens each of them computed (same order): a prefill chunk's length, 1 when
                                 # decoding (more only when a preempted request recomputes past its prompt)
    request_prefill: tuple = ()  # per request: True for a prefill chunk (it starts inside the prompt, as
                                 # prefill_tokens counts it), False for decode; the two sum to those columns


class LLMEngine:
    def __init__(self, model=None, tokenizer=None, device=None, dtype=None, kv: PagedKVConfig | None = None,
                 scheduler: SchedulerConfig | None = None, batch_invariant: bool | None = None,
                 max_model_len: int | None = None, clock=time.perf_counter, runner=None,
                 history: int = 100_000, threads: int | str | None = None) -> None:
        if isinstance(model, LLM):
            # these configure the loading of a model; a loaded LLM has them already
            given = {name: v for name, v in (("tokenizer", tokenizer), ("device", device), ("dtype", dtype),
                                             ("max_model_len", max_model_len), ("threads", threads)) if v is not None}
            if given:
                got = ", ".join(f"{k}={v!r}" for k, v in given.items())
                raise ConfigError(f"LLMEngine: {got} cannot be applied to an already loaded LLM; pass "
                                  f"{'/'.join(given)} to LLM(...) instead, or pass a model folder, preset or None")
            base = model
        else:
            base = LLM(model, tokenizer=tokenizer, device=device, dtype=dtype, max_model_len=max_model_len,
                       threads=threads)
        self.llm, self.model, self.tokenizer = base, base.model, base.tokenizer
        self.config = scheduler or SchedulerConfig()
        w = self.model.lm_head.weight
        default_tokens = self.config.max_num_seqs * min(base.max_model_len, 2048)
        self.pool = PagedKVPool(self.model.config, kv or PagedKVConfig(), w.device, w.dtype, default_tokens)
        if self.pool.offload is not None:
            raise ConfigError("LLMEngine: the offload tier of PagedKVConfig is not wired into the batched engine; "
                              "use preemption_mode='swap' for host memory")
        self.scheduler = Scheduler(self.config, self.pool.manager)
        self.runner = runner or ModelRunner(self.model, self.pool, batch_invariant)
        self.clock = clock
        self.seqs: dict[str, Sequence] = {}
        self.step_records: deque[StepRecord] = deque(maxlen=history)
        self._events: list[StreamEvent] = []     # events produced outside step() (rejections, aborts)
        self._ids = itertools.count()
        self.num_finished = 0

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None) -> str:
        """Queue a request; returns its id.  Bad input raises (ConfigError); a full queue ends
        the request with finish_reason "rejected" (its event comes with the next step)."""
        params = params or SamplingParams()
        text, ids = self.llm.encode(prompt)
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.seqs:
            raise ConfigError(f"request id {rid!r} is already in use")
        if not isinstance(priority, int):
            raise ConfigError(f"priority must be an integer, got {priority!r}")
        now = self.clock() if arrival_time is None else arrival_time
        max_new = min(params.max_tokens, self.llm.max_model_len - len(ids))
        seq = Sequence(rid, list(ids), len(ids), params, priority, now, max_new)
        out = RequestOutput(request_id=rid, prompt=text, prompt_token_ids=list(ids), priority=priority,
                            metrics=RequestMetrics(arrival_time=now, prompt_tokens=len(ids),
                                                   threads=torch.get_num_threads()))
        seq.output = out
        seq.state["proc"] = OutputProcessor(out, params, self.tokenizer, self.llm.eos_token_ids, max_new)
        seq.state["gen"] = params.generator(self.device)
        self.seqs[rid] = seq
        reason = self.scheduler.add(seq)
        if reason is not None:
            self._end(seq, "rejected", reason)
        return rid

    def abort(self, request_id: str, reason: str = "aborted by the caller") -> bool:
        """End a request now (e.g. its client disconnected); its blocks go back to the pool."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.finished:
            return False
        self._end(seq, "abort", reason)
        return True

    def fail(self, request_id: str, message: str) -> None:
        """End a request with finish_reason "error" (e.g. after a failed step)."""
        seq = self.seqs.get(request_id)
        if seq is not None and not seq.finished:
            self._end(seq, "error", message)

    def drain_events(self) -> list[StreamEvent]:
        """Events produced outside step() (rejections, aborts, failures), without stepping."""
        events, self._events = self._events, []
        return events

    def _end(self, seq: Sequence, finish: str, error: str | None) -> None:
        self.scheduler.finish(seq)
        self.runner.drop_swap(seq.request_id)
        now = self.clock()
        seq.state["proc"].finish(finish, now, error)
        out = seq.output
        self._events.append(StreamEvent(seq.request_id, len(out.token_ids), -1, "", now,
                                        now - seq.arrival_time, True, finish, error))
        self.num_finished += 1

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._events)

    def get_output(self, request_id: str) -> RequestOutput:
        return self.seqs[request_id].output

    def release(self, request_id: str) -> RequestOutput:
        """Forget a finished request (servers call this so memory does not grow)."""
        seq = self.seqs[request_id]
        if not seq.finished:
            raise ConfigError(f"request {request_id!r} is not finished")
        return self.seqs.pop(request_id).output

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[StreamEvent]:
        events, self._events = self._events, []
        try:
            return self._step(events)
        except BaseException:
            # nothing taken is lost: rejections / aborts from before (and during) this step, and any
            # token events it produced, stay queued for drain_events() or the next step
            self._events = events + self._events
            raise

    def _step(self, events: list[StreamEvent]) -> list[StreamEvent]:
        t0 = self.clock()
        out = self.scheduler.schedule(t0)
        t1 = self.clock()
        for seq, reason in out.rejected:
            self._end(seq, "rejected", reason)
        for s in out.swapped_out:
            self.runner.swap_out(s)
        for s in out.swapped_in:
            self.runner.swap_in(s)
            self.pool.manager.commit(s.seq.request_id, s.num_tokens)
        for seq in out.admitted:
            a = seq.state.pop("allocation")
            seq.output.num_cached_tokens = max(seq.output.num_cached_tokens, a.num_cached_tokens)
            if seq.output.prefix_miss_reason is None and seq.num_preemptions == 0:
                seq.output.prefix_miss_reason = None if a.miss_reason is None else a.miss_reason.value
        tokens: list[int] = []
        if out.scheduled:
            for s in out.scheduled:
                if s.seq.output.metrics.first_scheduled_time is None:
                    s.seq.output.metrics.first_scheduled_time = t1
            logits = self.runner.execute(out.scheduled)
            tokens = self._sample([s.seq for s in out.scheduled if s.samples], logits)
        t2 = self.clock()
        finished = 0
        sampled = iter(tokens)
        for s in out.scheduled:
            seq = s.seq
            seq.num_computed = s.start + s.num_tokens
            self.pool.manager.commit(seq.request_id, seq.num_computed)
            if not s.samples:
                continue
            token = next(sampled)
            seq.tokens.append(token)
            ev = seq.state["proc"].push(token, t2)
            seq.output.num_preemptions = seq.num_preemptions
            events.append(ev)
            if ev.finished:
                self.scheduler.finish(seq)
                self.num_finished += 1
                finished += 1
        t3 = self.clock()
        events += self._events          # rejections of this step
        self._events = []
        sch = self.scheduler
        self.step_records.append(StepRecord(
            out.step, t0, t1 - t0, t2 - t1, t3 - t2, len(out.scheduled), out.num_prefill_tokens,
            out.num_decode_tokens, len(sch.running), len(sch.waiting), len(sch.swapped),
            self.pool.manager.num_used_blocks, len(out.admitted), len(out.preempted), len(out.swapped_out),
            len(out.swapped_in), len(out.rejected), finished,
            tuple(s.seq.request_id for s in out.scheduled), tuple(s.num_tokens for s in out.scheduled),
            tuple(s.start < s.seq.prompt_len for s in out.scheduled)))
        return events

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        """One token per sequence; all greedy rows in one argmax (one device sync)."""
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        tokens = [0] * len(seqs)
        if greedy:
            for i, t in zip(greedy, logits[greedy].argmax(-1).tolist()):
                tokens[i] = t
        for i, s in enumerate(seqs):
            if not s.params.greedy:
                tokens[i] = int(sample(logits[i], s.params, s.state["gen"]))
        return tokens

    # ---- convenience ---------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 priorities: list[int] | None = None, use_tqdm: bool = False) -> list[RequestOutput]:
        """Submit every prompt now and run until all finish (continuous batching)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        now = self.clock()
        rids = [self.add_request(p, sp, priority=(priorities or [0] * len(prompts))[i], arrival_time=now)
                for i, (p, sp) in enumerate(zip(prompts, plist))]
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(rids), desc="generate", unit="req")
        pending = set(rids)
        while pending:
            for ev in self.step():
                if ev.finished and ev.request_id in pending:
                    pending.discard(ev.request_id)
                    if bar is not None:
                        bar.update()
        if bar is not None:
            bar.close()
        return [self.release(r) for r in rids]

    def stats(self) -> dict:
        """A snapshot for metrics endpoints and live views."""
        m, sch = self.pool.manager, self.scheduler
        return {"running": len(sch.running), "waiting": len(sch.waiting), "swapped": len(sch.swapped),
                "kv_used_blocks": m.num_used_blocks, "kv_total_blocks": m.num_blocks,
                "kv_usage": m.num_used_blocks / m.num_blocks, "prefix_hit_rate": m.stats.hit_rate,
                "preemptions": sch.num_preemptions, "rejected": sch.num_rejected, "finished": self.num_finished,
                "steps": sch.step_no}

    def steps_frame(self):
        import pandas as pd

        return pd.DataFrame([asdict(r) for r in self.step_records])
