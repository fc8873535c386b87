"""The engine - one for every mode: continuous batching over the paged KV pool, a cache per
sequence (contiguous: the reference; tiered), static decode buffers (compile, CUDA graphs).
``workbench.LLM`` is a front over it; ``LLM()`` is its reference configuration.

::

    eng = LLMEngine(scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256))
    outs = eng.generate(prompts, SamplingParams(temperature=0, max_tokens=32))   # all at once
    # or drive it: requests join and leave at every step
    rid = eng.add_request("The list type", params, priority=1)
    while eng.has_unfinished():
        for ev in eng.step(): ...                  # StreamEvents (what LLM.stream yields)
    eng.step_records                               # per step: batch, tokens, scheduler vs model time
    # parallel sampling (n > 1): more samples of one prompt, computed once on the paged pool
    first = eng.add_request(prompt, SamplingParams(temperature=0.8, seed=1))
    others = [eng.add_request(prompt, SamplingParams(temperature=0.8, seed=s), fork_of=first) for s in (2, 3)]

One :meth:`step` = schedule (pure Python) → swap copies → one batched forward → sampling →
stop checks.  Every request ends with output or an explicit reason ("rejected", "abort",
"error"), and its blocks go back to the pool.  The scheduler decides; a runner
(:mod:`workbench.engine.runners`) does the tensor work; both can be replaced (a fake runner
drives the property tests).

Around the class: :mod:`~workbench.engine.modes` (the model, KV and fast-path combinations, the
pool and runner each needs), :mod:`~workbench.engine.step_sampling` (a step's logits split and
sampled), :mod:`~workbench.engine.forks` (parallel sampling: held forks, adoption, release) and
:mod:`~workbench.engine.step_records` (per-step records).
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from workbench.engine.forks import Forks
from workbench.engine.metrics import RequestMetrics
from workbench.engine.config import EngineConfig
from workbench.engine.loaded import LoadedModel
from workbench.engine.modes import (describe, describe_error, describe_kv, describe_values, install_weight_streaming,
                                    kv_memory, make_pool, make_runner, prefetch_stats, resolve_model)
from workbench.engine.output import OutputProcessor
from workbench.engine.sizing import check_engine_memory
from workbench.engine.sampling import SamplingParams, sample
from workbench.engine.step_records import StepRecord, step_record, steps_frame
from workbench.engine.step_sampling import sample_batch, split_logits, take_token
from workbench.engine.types import RequestOutput, StreamEvent
from workbench.errors import ConfigError
from workbench.sched.scheduler import ScheduledSeq, Scheduler, SchedulerOutput
from workbench.sched.sequence import Sequence, SeqStatus

__all__ = ["LLMEngine", "StepRecord", "describe_error"]   # the last two re-exported (workbench.engine, AsyncEngine)


@dataclass
class StepOutput:
    """What one forward gave: the logits rows of the sampling sequences (in order), a token per
    sampling sequence (None where its sampling failed: ``errors`` says why), or the error the
    whole step failed with."""
    rows: torch.Tensor | None = None
    tokens: list[int | None] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)
    failed: str | None = None


class LLMEngine:
    """The engine: scheduler + block accounting + model runner + output processing.

    Fast paths (contiguous KV): ``static_decode`` runs decode steps on static buffers (the path
    CUDA graphs capture; eager), ``compile`` also ``torch.compile``s that step (on a CPU,
    inductor generates C++ for the whole step), ``cuda_graphs`` captures it per batch-size
    bucket (CUDA only).  Sampling on a kernel is the ``sampling`` op of ``workbench.transforms.backends``.

    ``LLMEngine(model, config)``: ``model`` a folder, ``"preset:<name>"``, None (the bundled
    model), a loaded :class:`~workbench.engine.loaded.LoadedModel` or :class:`~workbench.LLM` (its
    model is shared); ``config`` an :class:`~workbench.engine.config.EngineConfig` (checked once, by
    :meth:`~workbench.engine.config.EngineConfig.check`).  Or keywords, the config's parts by name
    (:meth:`~workbench.engine.config.EngineConfig.from_options`), whose defaults here are the
    serving set-up: the default paged pool and ``SchedulerConfig()``.  ``runner``: a custom runner
    on the paged pool, or a callable taking the pool and returning one (a fake one drives the
    property tests).

    ``kv``: where KV lives - a :class:`~workbench.kv.paged.PagedKVConfig` (None: the default
    paged pool, with prefix caching) or ``"contiguous"`` (one contiguous cache per sequence,
    the reference).  ``tiers`` (+ ``tier_basis``): one hot / warm / cold
    :class:`~workbench.kv.tiers.TieredKVCache` per sequence (the model's attention is switched
    to the tiered policy in place); with ``tier_store`` (a :class:`~workbench.kv.tiers_physical.TierStore`)
    the cache is the physical one: only the resident zones stay in fast memory, full blocks live
    in the store's offload tier and routed blocks come back through one prefetcher shared by the
    engine's sequences.  ``stream_weights``: a
    :class:`~workbench.prefetch.weights.WeightStreamConfig` - only some decoder layers stay
    resident, the others are fetched layer by layer ahead of use (the model is changed in place,
    for every engine that shares it).  A combination that cannot work raises ConfigError.

    ``memory_budget``: bytes (or ``"8G"``, ``"512M"``) the KV pool, its offload tier, the caches
    per sequence (``max_num_seqs`` x ``max_model_len``, the worst case admitted) and the static
    decode buffers may take together; each is also held to what its device has available.  The
    sizes are computed before anything is allocated (:mod:`workbench.engine.sizing`,
    ``self.memory_plan``) and a configuration that does not fit is a ConfigError naming the
    figure and the setting that makes it smaller.
    """

    def __init__(self, model=None, config: EngineConfig | None = None, *, runner=None, clock=time.perf_counter,
                 history: int = 100_000, **options) -> None:
        config = EngineConfig.from_options(config, who="LLMEngine", serving_defaults=config is None, **options)
        preloaded = isinstance(getattr(model, "loaded", model), LoadedModel)   # an LLM's or a LoadedModel
        base, loaded = resolve_model(model, config.load)
        config.check("LLMEngine", model=model, device=loaded.model.device, runner=runner, loaded=preloaded,
                     quantized=getattr(loaded.model, "recipe", None) is not None)
        self.config = config
        self.llm, self.loaded, self.model, self.tokenizer = base, loaded, loaded.model, loaded.tokenizer
        self.weight_streamer = install_weight_streaming(self.model, config.stream_weights)
        sched = config.scheduler_for(loaded.max_model_len)
        self.kv_mode, t = config.kv_mode, config.tiers
        self.tiers, self.tier_basis, self.tier_store = (t.config, t.basis, t.store) if t else (None, None, None)
        self.tier_prefetcher = None      # the physical tiered cache's shared prefetcher (made by make_runner)
        self.compiled, self.cuda_graphs = bool(config.fast.compile), bool(config.fast.cuda_graphs)
        self.static_decode = config.fast.static
        # what the pool, the caches and the static buffers will take, refused before any is allocated
        w = self.model.lm_head.weight
        self.memory_plan = check_engine_memory(self.model.config, w.device, w.dtype,
                                               max_model_len=loaded.max_model_len, **config.memory_args(sched))
        self.pool = make_pool(self.model, self.kv_mode, config.paged, sched, loaded.max_model_len,
                              self.static_decode, self.memory_plan.budget)
        self.scheduler = Scheduler(sched, self.pool.blocks)
        self.runner = make_runner(self, config.fast.batch_invariant, custom=runner)   # runner: one, or pool -> one
        self.clock = clock
        self.seqs: dict[str, Sequence] = {}
        self.step_records: deque[StepRecord] = deque(maxlen=history)
        self._events: list[StreamEvent] = []     # events produced outside step() (rejections, aborts)
        self.forks = Forks(self.scheduler, self._sample, self._end, self._finished)   # held for parents' prompts
        self._ids = itertools.count()
        self.num_finished = 0
        self.last_step_error: BaseException | None = None   # the last exception a step's requests ended on

    @property
    def max_model_len(self) -> int:
        return self.loaded.max_model_len

    # what inspectors and views read (KVInspector, KVBlockMapView, kv-inspect): the same names as on LLM
    @property
    def kv_pool(self):
        """The paged KV pool (None when KV lives in a cache per sequence)."""
        return self.pool if self.kv_mode == "paged" else None

    @property
    def active_caches(self) -> dict:
        """Sequence id -> its live per-sequence cache (contiguous or tiered KV)."""
        return getattr(self.runner, "caches", {})

    @property
    def last_cache(self):
        return getattr(self.runner, "last_cache", None)

    @property
    def eos_token_ids(self):
        return self.loaded.eos_token_ids

    def describe(self) -> str:
        """One line: the configuration that serves requests (metrics rows, /metrics, x-model-info)."""
        return describe(self)

    def describe_kv(self) -> str:
        """One line: where this engine keeps KV (metrics rows, headers)."""
        return describe_kv(self)

    @property
    def device(self) -> torch.device:
        return self.model.device

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                    priority: int = 0, arrival_time: float | None = None, output: RequestOutput | None = None,
                    fork_of: str | None = None) -> str:
        """Queue a request; returns its id.  Bad input raises (ConfigError); a full queue ends
        the request with finish_reason "rejected" (its event comes with the next step).
        ``output``: a RequestOutput to fill (the caller keeps a reference); default a new one.

        ``fork_of``: another sample of that request's prompt (parallel sampling, ``n > 1``:
        submit the first sample, then the others naming it).  The parent must be unfinished,
        have the same prompt tokens and not have computed its prompt yet (forks are declared
        with it); else ConfigError.  On the paged pool the fork's prompt is not computed: it
        samples its first token from the parent's last prompt row (its own params and seed)
        and shares the parent's blocks, ``output.num_cached_tokens`` = the prompt length
        (:mod:`workbench.engine.forks`: when it is released to compute its prompt itself).  With contiguous
        or tiered KV it is queued as any request."""
        params = params or SamplingParams()
        text, ids = self.loaded.encode(prompt)
        rid = request_id or (output.request_id if output is not None and output.request_id else None) \
            or f"req-{next(self._ids)}"
        if rid in self.seqs:
            raise ConfigError(f"request id {rid!r} is already in use")
        if not isinstance(priority, int):
            raise ConfigError(f"priority must be an integer, got {priority!r}")
        parent = None if fork_of is None else self.forks.parent(self.seqs, rid, fork_of, list(ids))
        now = self.clock() if arrival_time is None else arrival_time
        max_new = min(params.max_tokens, self.max_model_len - len(ids))
        seq = Sequence(rid, list(ids), len(ids), params, priority, now, max_new)
        out = output or RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[])
        out.request_id, out.prompt, out.prompt_token_ids, out.priority = rid, text, list(ids), priority
        out.metrics = RequestMetrics(arrival_time=now, prompt_tokens=len(ids), threads=torch.get_num_threads(),
                                     engine=self.fast_paths()["config"])
        if params.prompt_logprobs is not None:
            if self.static_decode and self.kv_mode != "paged":
                raise ConfigError("prompt_logprobs: this engine prefills on static contiguous decode buffers, which "
                                  "keep the last position's logits only; use the paged pool (kv=PagedKVConfig(), "
                                  "whose prompts prefill eagerly) or an engine without static_decode / compile / "
                                  "cuda_graphs")
            out.prompt_logprobs = [None] * len(ids)
        if params.logprobs is not None:
            out.logprobs = []
        seq.output = out
        seq.processor = OutputProcessor(out, params, self.tokenizer, self.eos_token_ids, max_new)
        seq.generator = params.generator(self.device)
        self.seqs[rid] = seq
        if parent is not None and self.kv_mode == "paged" and params.prompt_logprobs in (
                None, parent.params.prompt_logprobs):   # else only computing its prompt gives its prompt logprobs
            self.forks.hold(seq, parent)
            return rid
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

    def forget(self, request_ids, reason: str) -> None:
        """Abort what is still running of ``request_ids`` and release all of them (their
        events are dropped): nothing of a failed call stays queued for the next one."""
        for rid in request_ids:
            seq = self.seqs.get(rid)
            if seq is None:
                continue
            if not seq.finished:
                self._end(seq, "abort", reason)
            self.seqs.pop(rid, None)
        gone = set(request_ids)
        self._events = [ev for ev in self._events if ev.request_id not in gone]

    def drain_events(self) -> list[StreamEvent]:
        """Events produced outside step() (rejections, aborts, failures), without stepping."""
        events, self._events = self._events, []
        return events

    def _end(self, seq: Sequence, finish: str, error: str | None) -> None:
        if seq.status is SeqStatus.HELD:
            self.forks.unhold(seq)
        else:
            self.forks.release(seq)
        self.scheduler.finish(seq)
        self.runner.drop_swap(seq.request_id)
        now = self.clock()
        seq.processor.finish(finish, now, error)
        out = seq.output
        self._events.append(StreamEvent(seq.request_id, len(out.token_ids), -1, "", now,
                                        now - seq.arrival_time, True, finish, error))
        self.num_finished += 1

    @property
    def num_held(self) -> int:
        """Forks waiting for their parent's prompt (queued nowhere in the scheduler)."""
        return self.forks.num_held

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._events) or bool(self.forks)

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
        """One step: schedule → carry out its decisions → execute → update from the output → its
        record.  Returns the step's events (and those produced since the last step)."""
        events, self._events = self._events, []
        try:
            t0 = self.clock()
            out = self.scheduler.schedule(t0)
            t1 = self.clock()
            self._carry_out(out, t0)
            result = self._execute(out, t1)
            t2 = self.clock()
            ended = self._update(out, result, t1, t2, events)
            t3 = self.clock()
        except BaseException:
            # nothing taken is lost: rejections / aborts from before (and during) this step, and any
            # token events it produced, stay queued for drain_events() or the next step
            self._events = events + self._events
            raise
        events += self._events          # rejections of this step
        self._events = []
        self.step_records.append(step_record(out, self.scheduler, self.pool.manager.num_used_blocks,
                                             t0, t1, t2, t3, ended))
        return events

    def _carry_out(self, out: SchedulerOutput, t0: float) -> None:
        """What the schedule decided before the forward: forks of preempted parents released,
        rejections ended, swap copies, the KV lookahead, what each admission reused."""
        for seq in out.preempted + [s.seq for s in out.swapped_out]:
            self.forks.release(seq)
        for seq, reason in out.rejected:
            self._end(seq, "rejected", reason)
        for s in out.swapped_out:
            self.runner.swap_out(s)
        for s in out.swapped_in:
            self.runner.swap_in(s)
            self.scheduler.commit_swap_in(s)
        if self.pool.lookahead:    # KV prefetch: stage the next requests' offloaded / swapped KV (PagedKVConfig)
            self.pool.kv_prefetch.lookahead(self.scheduler, t0)
        for seq in out.admitted:
            a, seq.allocation = seq.allocation, None
            seq.output.num_cached_tokens = max(seq.output.num_cached_tokens, a.num_cached_tokens)
            if seq.output.prefix_miss_reason is None and seq.num_preemptions == 0:
                seq.output.prefix_miss_reason = None if a.miss_reason is None else a.miss_reason.value

    def _execute(self, out: SchedulerOutput, t1: float) -> StepOutput:
        """The runner's forward over the scheduled chunks, then one token per sampling sequence.  A
        failed forward is kept (its requests end with it), not raised: the engine goes on."""
        result = StepOutput()
        if not out.scheduled:
            return result
        for s in out.scheduled:
            if s.seq.output.metrics.first_scheduled_time is None:
                s.seq.output.metrics.first_scheduled_time = t1
        try:
            logits = self.runner.execute(out.scheduled)
        except Exception as e:  # noqa: BLE001 - the step's requests end, the engine goes on
            result.failed = f"engine step {out.step} failed: {describe_error(e)}"
            self.last_step_error = e
        else:
            result.rows = split_logits(out.scheduled, logits)
            result.tokens, result.errors = self._sample([s.seq for s in out.scheduled if s.samples], result.rows)
        return result

    def _update(self, out: SchedulerOutput, result: StepOutput, t1: float, t2: float,
                events: list[StreamEvent]) -> int:
        """The scheduler commits what the step computed and finishes the requests whose token ended
        them; the output side takes each sampled token (its event, stop checks) and starts the forks
        held for a parent whose prompt is now computed.  Returns how many requests ended."""
        if result.failed is not None:     # only the requests of this step: waiting ones are untouched
            for s in out.scheduled:
                self._end(s.seq, "error", result.failed)
            return len(out.scheduled)
        ended = 0
        sampled = iter(enumerate(result.tokens))

        def take(s: ScheduledSeq) -> bool:
            nonlocal ended
            row, token = next(sampled)
            seq = s.seq
            if token is None:                 # its sampling failed: it ends alone, with the reason
                self._end(seq, "error", result.errors[seq.request_id])
                ended += 1
                return False
            last_row, seq.last_row = seq.last_row, None
            done = take_token(seq, token, last_row, t2, events)
            if seq.request_id in self.forks:   # its prompt is computed: its held forks start (before it may end)
                ended += self.forks.start(seq, result.rows[row], t1, t2, events)
            if done:
                self.num_finished += 1
                ended += 1
            return done

        self.scheduler.update_from_output(out, take)
        return ended

    def _finished(self, seq: Sequence) -> None:
        """``seq`` ended on the token it took (a fork's first): out of the scheduler, counted."""
        self.scheduler.finish(seq)
        self.num_finished += 1

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int | None], dict[str, str]]:
        """One token per sequence, and the sequences whose sampling failed (id -> why; their token
        is None): :func:`~workbench.engine.step_sampling.sample_batch` with this module's
        ``sample`` (looked up per call: tests replace it to make chosen requests fail)."""
        return sample_batch(self.model, seqs, logits, sample)

    # ---- convenience ---------------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 priorities: list[int] | None = None, use_tqdm: bool = False, on_events=None) -> list[RequestOutput]:
        """Submit every prompt now and run until all finish (continuous batching).  ``on_events``:
        called with each step's events (other consumers' requests may be among them).  On an
        error nothing of this call stays queued."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        now = self.clock()
        rids: list[str] = []
        bar = None
        try:
            for i, (p, sp) in enumerate(zip(prompts, plist)):
                rids.append(self.add_request(p, sp, priority=(priorities or [0] * len(prompts))[i], arrival_time=now))
            if use_tqdm:
                from tqdm.auto import tqdm
                bar = tqdm(total=len(rids), desc="generate", unit="req")
            pending = set(rids)
            while pending:
                events = self.step()
                for ev in events:
                    if ev.finished and ev.request_id in pending:
                        pending.discard(ev.request_id)
                        if bar is not None:
                            bar.update()
                if on_events is not None:
                    on_events(events)
        except BaseException:
            self.forget(rids, "generate() failed or was interrupted")
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self.release(r) for r in rids]

    def stats(self) -> dict:
        """A snapshot for metrics endpoints and live views."""
        m, sch = self.pool.manager, self.scheduler
        held = self.num_held   # forks waiting for their parent's prompt: queued as far as a caller can tell
        return {"running": len(sch.running), "waiting": len(sch.waiting) + held, "held": held,
                "swapped": len(sch.swapped), "kv_used_blocks": m.num_used_blocks, "kv_total_blocks": m.num_blocks,
                "kv_usage": m.num_used_blocks / m.num_blocks, "prefix_hit_rate": m.stats.hit_rate,
                "preemptions": sch.num_preemptions, "rejected": sch.num_rejected, "finished": self.num_finished,
                "steps": sch.step_no, "engine": self.fast_paths(), "prefetch": prefetch_stats(self),
                "kv_memory": kv_memory(self)}

    def fast_paths(self) -> dict:
        """The configuration as plain values (``/metrics`` labels, ``x-model-info``); remade only
        when the model's backends or the scheduler's batch size change (read after every step)."""
        ops = self.model.ops          # the backends' entry points (None: the reference modules)
        key = (ops and tuple(ops.backends.items()),
               self.scheduler.config.max_num_seqs, id(self.weight_streamer))
        if getattr(self, "_fast_paths_key", None) != key:
            self._fast_paths, self._fast_paths_key = describe_values(self), key
        return dict(self._fast_paths)

    def steps_frame(self):
        """The step records as a pandas DataFrame, one row per step."""
        return steps_frame(self.step_records)

