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

Forks (``add_request(..., fork_of=parent)``, parallel sampling): on the paged pool a fork is
held until the step that samples its parent's first token, samples its own first token from the
same logits row, and then runs on the parent's prompt blocks (shared; copy-on-write on the
partly filled last one), so the prompt is computed once for all samples.  Whenever that cannot
happen (no room in ``max_num_seqs``, the parent ends or is preempted first, the fork wants
prompt logprobs the parent does not compute) it is released into the waiting queue and computes
its prompt itself.  Per-sequence KV (contiguous, tiered) has nothing to share: forks queue as
any request.
"""

from __future__ import annotations

import copy
import itertools
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass

import torch

from workbench.engine.types import RequestOutput, StreamEvent
from workbench.errors import ConfigError
from workbench.kv.paged import PagedKVConfig, PagedKVPool
from workbench.model.kv_cache import KVCache
from workbench.engine.loaded import LoadedModel
from workbench.engine.metrics import RequestMetrics
from workbench.engine.output import OutputProcessor
from workbench.engine.sampling import SamplingParams, sample, token_logprobs
from workbench.sched.config import SchedulerConfig
from workbench.engine.runners import ContiguousRunner, ModelRunner, StaticRunner
from workbench.sched.scheduler import Scheduler
from workbench.sched.sequence import Sequence, SeqStatus


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
    """The engine: scheduler + block accounting + model runner + output processing.

    Fast paths (contiguous KV): ``static_decode`` runs decode steps on static buffers (the path
    CUDA graphs capture; eager), ``compile`` also ``torch.compile``s that step (on a CPU,
    inductor generates C++ for the whole step), ``cuda_graphs`` captures it per batch-size
    bucket (CUDA only).  Sampling on a kernel is the ``sampling`` op of ``workbench.transforms.backends``.

    ``model``: a folder, ``"preset:<name>"``, None (the bundled model), a loaded
    :class:`~workbench.engine.loaded.LoadedModel` or :class:`~workbench.LLM` (its model is shared).
    ``kv``: where KV lives - a :class:`~workbench.kv.paged.PagedKVConfig` (None: the default
    paged pool, with prefix caching) or ``"contiguous"`` (one contiguous cache per sequence,
    the reference).  ``tiers`` (+ ``tier_basis``): one hot / warm / cold
    :class:`~workbench.kv.tiers.TieredKVCache` per sequence (the model's attention is switched
    to the tiered policy in place).  A combination that cannot work raises ConfigError.
    """

    def __init__(self, model=None, tokenizer=None, device=None, dtype=None, kv: PagedKVConfig | str | None = None,
                 scheduler: SchedulerConfig | None = None, batch_invariant: bool | None = None,
                 max_model_len: int | None = None, clock=time.perf_counter, runner=None,
                 history: int = 100_000, threads: int | str | None = None, tiers=None, tier_basis=None,
                 compile: bool = False, cuda_graphs: bool = False, static_decode: bool = False) -> None:
        loaded = getattr(model, "loaded", model)
        if isinstance(loaded, LoadedModel):
            # these configure the loading of a model; a loaded one has them already
            given = {name: v for name, v in (("tokenizer", tokenizer), ("device", device), ("dtype", dtype),
                                             ("max_model_len", max_model_len), ("threads", threads)) if v is not None}
            if given:
                got = ", ".join(f"{k}={v!r}" for k, v in given.items())
                raise ConfigError(f"LLMEngine: {got} cannot be applied to an already loaded LLM; pass "
                                  f"{'/'.join(given)} to LLM(...) instead, or pass a model folder, preset or None")
            base = model
        else:
            base = loaded = LoadedModel.load(model, tokenizer=tokenizer, device=device, dtype=dtype,
                                             max_model_len=max_model_len, threads=threads)
        self.llm, self.loaded, self.model, self.tokenizer = base, loaded, loaded.model, loaded.tokenizer
        self.config = scheduler or SchedulerConfig()
        self.kv_mode = _kv_mode(kv, tiers, self.config, runner)
        self.tiers, self.tier_basis = tiers, tier_basis
        self.compiled, self.cuda_graphs = bool(compile), bool(cuda_graphs)
        self.static_decode = bool(static_decode or compile or cuda_graphs)
        if self.static_decode:
            _check_fast_paths(self.kv_mode, loaded.model, cuda_graphs, runner)
            if batch_invariant:
                raise ConfigError("LLMEngine: batch_invariant=True is a property of the eager packed path; static "
                                  "decode steps attend over whole buffer rows (leave batch_invariant unset)")
        w = self.model.lm_head.weight
        if self.config.max_num_seqs == 1:   # one request at a time: room for it and cached prefixes of 3 more
            default_tokens = 4 * loaded.max_model_len
        else:
            default_tokens = self.config.max_num_seqs * min(loaded.max_model_len, 2048)
        if self.kv_mode == "paged":
            self.pool = PagedKVPool(self.model.config, kv or PagedKVConfig(), w.device, w.dtype, default_tokens)
        else:   # per-sequence caches: the pool only counts blocks (admission, preemption, inspectors)
            default_tokens = self.config.max_num_seqs * loaded.max_model_len
            self.pool = PagedKVPool(self.model.config, PagedKVConfig(enable_prefix_caching=False), w.device,
                                    w.dtype, default_tokens, tensors=False)
        self.scheduler = Scheduler(self.config, self.pool.blocks)
        self.runner = runner or self._make_runner(batch_invariant)
        self.clock = clock
        self.seqs: dict[str, Sequence] = {}
        self.step_records: deque[StepRecord] = deque(maxlen=history)
        self._events: list[StreamEvent] = []     # events produced outside step() (rejections, aborts)
        self._held: dict[str, list[Sequence]] = {}   # parent id -> forks waiting for its prompt (paged KV)
        self._ids = itertools.count()
        self.num_finished = 0
        self.last_step_error: BaseException | None = None   # the last exception a step's requests ended on

    def _make_runner(self, batch_invariant):
        if self.static_decode:
            return StaticRunner(self.model, self.pool, self.max_model_len, self.config.max_num_seqs,
                                compile=self.compiled, cuda_graphs=self.cuda_graphs)
        if self.kv_mode == "paged":
            return ModelRunner(self.model, self.pool, batch_invariant, direct=self.config.max_num_seqs == 1)
        w = self.model.lm_head.weight
        cfg = self.model.config
        if self.kv_mode == "tiered":
            from workbench.kv.tiers import TieredKVCache, apply_tiered_attention

            TieredKVCache(cfg, self.tiers, self.tier_basis, max_len=1)   # validate now, not per request
            apply_tiered_attention(self.model)                           # other caches keep the exact path
            tiers, basis = self.tiers, self.tier_basis

            def make(n):
                return TieredKVCache(cfg, tiers, basis, max_len=n, device=w.device, dtype=w.dtype)
        else:
            def make(n):
                return KVCache(cfg, 1, n, device=w.device, dtype=w.dtype)
        return ContiguousRunner(self.model, self.pool, make, direct=self.config.max_num_seqs == 1,
                                batch_invariant=batch_invariant, keep_last=self.kv_mode == "tiered")

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
        from workbench.transforms.backends import current_backends

        cfg = self.config
        parts = [self.describe_kv(), f"seqs={cfg.max_num_seqs}"]
        if cfg.max_num_seqs > 1 or cfg.chunked_prefill and cfg.max_num_batched_tokens < self.max_model_len:
            parts.append(f"tokens={cfg.max_num_batched_tokens}" + (" chunked" if cfg.chunked_prefill else ""))
        parts += [name for name, on in (("static-decode", self.static_decode and not (self.compiled or self.cuda_graphs)),
                                        ("compile", self.compiled), ("cuda-graphs", self.cuda_graphs)) if on]
        ops = {op: b for op, b in current_backends(self.model).items() if b != "eager"}
        if ops:
            parts.append("backends " + ",".join(f"{op}={b}" for op, b in ops.items()))
        return " ".join(parts)

    def describe_kv(self) -> str:
        """One line: where this engine keeps KV (metrics rows, headers)."""
        if self.kv_mode == "paged":
            c = self.pool.config
            extra = (" prefix-cache" if c.enable_prefix_caching else "") + (f" offload={c.offload}" if c.offload else "")
            return f"paged bs={c.block_size} blocks={self.pool.num_blocks}{extra}"
        return "tiered " + self.tiers.name if self.kv_mode == "tiered" else "contiguous"

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
        and shares the parent's blocks, ``output.num_cached_tokens`` = the prompt length (see
        the module doc for when it is released to compute its prompt itself).  With contiguous
        or tiered KV it is queued as any request."""
        params = params or SamplingParams()
        text, ids = self.loaded.encode(prompt)
        rid = request_id or (output.request_id if output is not None and output.request_id else None) \
            or f"req-{next(self._ids)}"
        if rid in self.seqs:
            raise ConfigError(f"request id {rid!r} is already in use")
        if not isinstance(priority, int):
            raise ConfigError(f"priority must be an integer, got {priority!r}")
        parent = None if fork_of is None else self._fork_parent(rid, fork_of, list(ids))
        now = self.clock() if arrival_time is None else arrival_time
        max_new = min(params.max_tokens, self.max_model_len - len(ids))
        seq = Sequence(rid, list(ids), len(ids), params, priority, now, max_new)
        out = output or RequestOutput(request_id=rid, prompt=None, prompt_token_ids=[])
        out.request_id, out.prompt, out.prompt_token_ids, out.priority = rid, text, list(ids), priority
        out.metrics = RequestMetrics(arrival_time=now, prompt_tokens=len(ids), threads=torch.get_num_threads(),
                                     engine=self.fast_paths()["config"])
        if params.prompt_logprobs is not None:
            if self.static_decode:
                raise ConfigError("prompt_logprobs: this engine prefills on static decode buffers, which keep the "
                                  "last position's logits only; use an engine without static_decode / compile / "
                                  "cuda_graphs")
            out.prompt_logprobs = [None] * len(ids)
        if params.logprobs is not None:
            out.logprobs = []
        seq.output = out
        seq.state["proc"] = OutputProcessor(out, params, self.tokenizer, self.eos_token_ids, max_new)
        seq.state["gen"] = params.generator(self.device)
        self.seqs[rid] = seq
        if parent is not None and self.kv_mode == "paged" and params.prompt_logprobs in (
                None, parent.params.prompt_logprobs):   # else only computing its prompt gives its prompt logprobs
            self.scheduler.hold(seq)
            seq.state["fork_of"] = parent.request_id
            self._held.setdefault(parent.request_id, []).append(seq)
            return rid
        reason = self.scheduler.add(seq)
        if reason is not None:
            self._end(seq, "rejected", reason)
        return rid

    def _fork_parent(self, rid: str, fork_of: str, ids: list[int]) -> Sequence:
        """The request a fork shares its prompt with (a held fork's own parent when ``fork_of``
        names a held fork), or ConfigError saying why it cannot be forked."""
        parent = self.seqs.get(fork_of)
        if parent is not None and parent.status is SeqStatus.HELD:
            parent = self.seqs[parent.state["fork_of"]]
        if parent is None or parent.finished:
            raise ConfigError(f"request {rid!r}: fork_of={fork_of!r} names no unfinished request; submit the first "
                              "sample before the samples that fork it")
        if parent.tokens[:parent.prompt_len] != ids:
            raise ConfigError(f"request {rid!r} cannot fork {fork_of!r}: their prompts differ ({len(ids)} vs "
                              f"{parent.prompt_len} tokens); a fork is another sample of the same prompt")
        if parent.num_generated:
            raise ConfigError(f"request {rid!r} cannot fork {fork_of!r}: it has computed its prompt already (its "
                              "first token is sampled); forks are submitted with their parent, before it runs")
        return parent

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
            self._unhold(seq)
        else:
            self._release_forks(seq)
        self.scheduler.finish(seq)
        self.runner.drop_swap(seq.request_id)
        now = self.clock()
        seq.state["proc"].finish(finish, now, error)
        out = seq.output
        self._events.append(StreamEvent(seq.request_id, len(out.token_ids), -1, "", now,
                                        now - seq.arrival_time, True, finish, error))
        self.num_finished += 1

    def _unhold(self, child: Sequence) -> None:
        """Take a held fork off its parent's list (it is adopted, released or ended)."""
        parent_id = child.state.pop("fork_of")
        held = self._held[parent_id]
        held.remove(child)
        if not held:
            del self._held[parent_id]

    def _release_forks(self, parent: Sequence) -> None:
        """The forks held for ``parent`` will not share its prompt (it ended or was preempted
        first): they join the waiting queue and compute their prompt themselves."""
        for child in list(self._held.get(parent.request_id, ())):
            self._unhold(child)
            self.scheduler.queue_held(child)

    @property
    def num_held(self) -> int:
        """Forks waiting for their parent's prompt (queued nowhere in the scheduler)."""
        return sum(map(len, self._held.values()))

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0 or bool(self._events) or bool(self._held)

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
        for seq in out.preempted + [s.seq for s in out.swapped_out]:
            self._release_forks(seq)
        for seq, reason in out.rejected:
            self._end(seq, "rejected", reason)
        for s in out.swapped_out:
            self.runner.swap_out(s)
        for s in out.swapped_in:
            self.runner.swap_in(s)
            self.scheduler.manager.commit(s.seq.request_id, s.num_tokens)
        for seq in out.admitted:
            a = seq.state.pop("allocation")
            seq.output.num_cached_tokens = max(seq.output.num_cached_tokens, a.num_cached_tokens)
            if seq.output.prefix_miss_reason is None and seq.num_preemptions == 0:
                seq.output.prefix_miss_reason = None if a.miss_reason is None else a.miss_reason.value
        tokens: list[int | None] = []
        errors: dict[str, str] = {}
        step_failed = None
        if out.scheduled:
            for s in out.scheduled:
                if s.seq.output.metrics.first_scheduled_time is None:
                    s.seq.output.metrics.first_scheduled_time = t1
            try:
                logits = self.runner.execute(out.scheduled)
            except Exception as e:  # noqa: BLE001 - the step's requests end, the engine goes on
                step_failed = f"engine step {out.step} failed: {describe_error(e)}"
                self.last_step_error = e
            else:
                rows = self._split_logits(out.scheduled, logits)
                tokens, errors = self._sample([s.seq for s in out.scheduled if s.samples], rows)
        t2 = self.clock()
        finished = 0
        sampled = iter(enumerate(tokens))
        for s in out.scheduled:
            seq = s.seq
            if step_failed is not None:       # only the requests of this step: waiting ones are untouched
                self._end(seq, "error", step_failed)
                finished += 1
                continue
            seq.num_computed = s.start + s.num_tokens
            self.scheduler.manager.commit(seq.request_id, seq.num_computed)
            if not s.samples:
                continue
            row, token = next(sampled)
            if token is None:                 # its sampling failed: it ends alone, with the reason
                self._end(seq, "error", errors[seq.request_id])
                finished += 1
                continue
            seq.tokens.append(token)
            ev = seq.state["proc"].push(token, t2)
            if seq.params.logprobs is not None:      # the model's log-probability of the token it chose
                ev.logprobs = token_logprobs(seq.state.pop("last_row")[None], [token], seq.params.logprobs)[0]
                seq.output.logprobs.append(ev.logprobs)
            seq.output.num_preemptions = seq.num_preemptions
            events.append(ev)
            if seq.request_id in self._held:   # its prompt is computed: its held forks start (before it may end)
                finished += self._fork(seq, rows[row], t1, t2, events)
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

    def _fork(self, parent: Sequence, row: torch.Tensor, t1: float, now: float, events: list[StreamEvent]) -> int:
        """The step sampled ``parent``'s first token from ``row`` (its last prompt position): each
        fork held for it samples its own first token from the same row and runs on the parent's
        blocks, as many as ``max_num_seqs`` leaves room for; the others are released to the
        waiting queue before they draw anything (so a seeded one computes what it would have
        alone).  Returns how many forks finished with their first token."""
        held = list(self._held[parent.request_id])
        room = max(0, self.config.max_num_seqs - len(self.scheduler.running))
        for child in held[room:]:
            self._unhold(child)
            self.scheduler.queue_held(child)
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
            self._unhold(child)
            self.scheduler.adopt_fork(parent, child, now)
            out = child.output
            out.num_cached_tokens = child.prompt_len
            out.metrics.first_scheduled_time = t1
            if child.params.prompt_logprobs is not None:   # the same k as the parent's (else it was not held)
                out.prompt_logprobs = copy.deepcopy(parent.output.prompt_logprobs)
            child.tokens.append(token)
            ev = child.state["proc"].push(token, now)
            if child.params.logprobs is not None:
                ev.logprobs = token_logprobs(row[None], [token], child.params.logprobs)[0]
                out.logprobs.append(ev.logprobs)
            events.append(ev)
            if ev.finished:
                self.scheduler.finish(child)
                self.num_finished += 1
                finished += 1
        return finished

    def _split_logits(self, scheduled, logits: torch.Tensor) -> torch.Tensor:
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
            if k and seq.params.prompt_logprobs is not None and s.start < n_prompt:
                pos = [s.start + j for j in range(k) if s.start + j + 1 < n_prompt]   # row j predicts token p + 1
                if pos:
                    entries = token_logprobs(chunk[:len(pos)], [seq.tokens[p + 1] for p in pos],
                                             seq.params.prompt_logprobs)
                    lst = seq.output.prompt_logprobs
                    for p, e in zip(pos, entries):
                        lst[p + 1] = e
            if s.samples:
                sample_rows.append(chunk[-1])
                if seq.params.logprobs is not None:
                    seq.state["last_row"] = chunk[-1]
        if off != logits.shape[0]:
            raise RuntimeError(f"runner returned {logits.shape[0]} rows of logits, the step wants {off}")
        return torch.stack(sample_rows) if sample_rows else logits[:0]

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> tuple[list[int | None], dict[str, str]]:
        """One token per sequence, and the sequences whose sampling failed (id -> why; their
        token is None): a failure belongs to its request, the others keep their tokens.  All
        greedy rows go in one argmax (one device sync).  With the ``sampling`` op on a kernel
        backend (``--backend sampling=triton``), one launch for the whole batch, each sampled row
        drawing its noise from its own request's generator (a failed launch is retried row by
        row, so that only the failing rows fail)."""
        ops = getattr(self.model, "_wb_ops", None)
        kernel = ops is not None and ops.backends.get("sampling", "eager") != "eager"
        tokens: list[int | None] = [None] * len(seqs)
        errors: dict[str, str] = {}
        if kernel:
            try:
                return self._sample_kernel(ops, seqs, logits), errors
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
                    tokens[i] = self._sample_kernel(ops, [s], logits[i:i + 1])[0]
                else:
                    tokens[i] = int(sample(logits[i], s.params, s.state["gen"]))
            except Exception as e:  # noqa: BLE001
                errors[s.request_id] = f"sampling failed: {describe_error(e)}"
        return tokens, errors

    @staticmethod
    def _sample_kernel(ops, seqs: list[Sequence], logits: torch.Tensor) -> list[int]:
        from workbench_kernels.sampling import gumbel_noise

        x = logits.float()
        if all(s.params.greedy for s in seqs):
            return ops.greedy_tokens(x).tolist()
        V = x.shape[1]
        noise = torch.cat([torch.zeros(1, V, device=x.device) if s.params.greedy
                           else gumbel_noise(1, V, s.state["gen"], x.device) for s in seqs])
        return ops.sample_tokens(x, temperature=[0.0 if s.params.greedy else s.params.temperature for s in seqs],
                                 top_k=[s.params.top_k for s in seqs], top_p=[s.params.top_p for s in seqs],
                                 gumbel=noise).tolist()

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
                "steps": sch.step_no, "engine": self.fast_paths()}

    def fast_paths(self) -> dict:
        """The configuration as plain values (``/metrics`` labels, ``x-model-info``); remade only
        when the model's backends or the scheduler's batch size change (read after every step)."""
        key = (getattr(self.model, "_wb_backends", None) and tuple(self.model._wb_backends.items()),
               self.config.max_num_seqs)
        if getattr(self, "_fast_paths_key", None) != key:
            from workbench.transforms.backends import current_backends

            self._fast_paths = {"config": self.describe(), "kv": self.kv_mode, "static_decode": self.static_decode,
                                "compile": self.compiled, "cuda_graphs": self.cuda_graphs,
                                "sampling": current_backends(self.model).get("sampling", "eager")}
            self._fast_paths_key = key
        return dict(self._fast_paths)

    def steps_frame(self):
        import pandas as pd

        return pd.DataFrame([asdict(r) for r in self.step_records])


def _kv_mode(kv, tiers, config: SchedulerConfig, runner) -> str:
    """"paged", "contiguous" or "tiered", or a ConfigError saying why the combination cannot work."""
    if tiers is not None:
        if kv is not None:
            raise ConfigError("LLMEngine: give kv= (where KV lives) or tiers= (a tiered cache per sequence), not both")
        mode = "tiered"
    elif isinstance(kv, str):
        if kv != "contiguous":
            raise ConfigError(f"LLMEngine: kv must be a PagedKVConfig, 'contiguous' or None, got {kv!r}")
        mode = "contiguous"
    elif kv is None or isinstance(kv, PagedKVConfig):
        mode = "paged"
    else:
        raise ConfigError(f"LLMEngine: kv must be a PagedKVConfig, 'contiguous' or None, got {type(kv).__name__}")
    if mode != "paged" and config.preemption_mode == "swap":
        raise ConfigError(f"LLMEngine: preemption_mode='swap' needs the paged pool; the {mode} KV cache is kept "
                          "per sequence and is recomputed after preemption (use preemption_mode='recompute')")
    if mode != "paged" and runner is not None:
        raise ConfigError(f"LLMEngine: a custom runner needs the paged pool (kv=PagedKVConfig), not {mode} KV")
    return mode


def _check_fast_paths(kv_mode: str, model, cuda_graphs: bool, runner) -> None:
    """static decode / compile / CUDA graphs run decode steps on static contiguous buffers
    (:class:`~workbench.engine.runners.StaticRunner`)."""
    if cuda_graphs and model.device.type != "cuda":
        raise ConfigError(f"LLMEngine: cuda_graphs=True needs a CUDA device; the model is on {model.device} "
                          "(compile=True is the CPU's whole-step fast path)")
    if runner is not None:
        raise ConfigError("LLMEngine: compile / cuda_graphs bring their own runner; do not pass runner=")
    if kv_mode != "contiguous":
        raise ConfigError(f"LLMEngine: compile / cuda_graphs run decode steps over static contiguous KV buffers; "
                          f"{kv_mode} KV is not implemented on that path yet (use kv='contiguous', the LLM default)")


def describe_error(e: BaseException) -> str:
    """``TypeName: message`` of an exception, one line (what a request's error says)."""
    return "".join(traceback.format_exception_only(type(e), e)).strip()
