"""``LLM``: the offline front over the engine (:class:`workbench.engine.core.LLMEngine`).

::

    llm = LLM()                                     # the bundled model, the reference configuration
    out = llm.generate(["The list type"], SamplingParams(temperature=0, max_tokens=32))
    for ev in llm.stream("The list type", SamplingParams(max_tokens=8)):
        print(ev.text, ev.time)

There is one engine.  ``LLM`` adds requests to it and steps it: :meth:`generate` adds every
prompt and steps until all are done; :meth:`stream` adds one and steps until it ends (and
aborts it if the caller stops early).  What differs between "the reference" and "the
optimised stack" is the engine's *configuration*:

* **the reference configuration** (the default): one sequence at a time, no chunking, a
  contiguous KV cache per request, and every step exactly ``model(ids, start, cache,
  logits_to_keep=1)`` followed by :func:`workbench.engine.sampling.sample` - the baseline every layer
  is measured against (``workbench bench`` compares it with transformers);
* ``kv=PagedKVConfig(...)``: the paged pool with cross-request prefix caching (and an offload
  tier), ``tiers=``: a hot / warm / cold cache per request, ``scheduler=SchedulerConfig(...)``:
  continuous batching - the same engine, other parts plugged in.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager
from dataclasses import replace
from collections.abc import Iterator, Sequence

import torch

from workbench.engine.types import RequestOutput, StreamEvent
from workbench.errors import ConfigError, DataError, WorkbenchError
from workbench.engine.loaded import LoadedModel, Prompt, is_compressed
from workbench.engine.metrics import requests_frame, summarize
from workbench.model.decoder import CausalLM
from workbench.model.loader import resolve_device
from workbench.engine.sampling import SamplingParams, sample
from workbench.sched.config import SchedulerConfig
from workbench.engine.core import LLMEngine
from workbench.engine.config import EngineConfig, LoadOptions, reference_scheduler
from workbench.engine.sizing import check_before_loading
from workbench.measure.allocation import parse_bytes
from workbench.quant.apply import quantize_model, set_quant_backend
from workbench.quant.recipe import resolve_recipe
from workbench.data import heldout_split, windows_from_spec

__all__ = ["LLM", "Prompt", "ReferenceLoop", "RequestOutput", "StreamEvent", "reference_generate",
           "reference_scheduler"]


class ReferenceLoop:
    """The decode loop, written once, with nothing around it: what one step of the reference
    configuration computes.  For teaching (notebook 00) and for instruments that need the bare
    step (the profiler's hooks, the engine-overhead row of ``workbench bench``)::

        loop = ReferenceLoop(model, prompt_ids, max_new_tokens=32)
        token = loop.step()                  # prefill, sample the first token
        logits = loop.forward()              # a decode step: model(token, pos, cache)[-1] ...
        token = loop.sample(logits)          # ... then sampling; the two halves can be timed apart
    """

    def __init__(self, model: CausalLM, prompt_ids: list[int], max_new_tokens: int,
                 params: SamplingParams | None = None) -> None:
        self.model, self.params = model, params or SamplingParams(temperature=0)
        self.cache = model.new_cache(1, len(prompt_ids) + max_new_tokens)
        self.gen = self.params.generator(model.device)
        self.pending, self.pos = list(prompt_ids), 0

    @torch.inference_mode()
    def forward(self) -> torch.Tensor:
        """One model call on the tokens not yet in the cache: logits of the last one [V]."""
        x = torch.tensor([self.pending], device=self.model.device)
        logits = self.model(x, self.pos, self.cache, logits_to_keep=1)[0, -1]
        self.pos += len(self.pending)
        return logits

    def sample(self, logits: torch.Tensor) -> int:
        token = int(sample(logits, self.params, self.gen))     # int(): the id is on the host
        self.pending = [token]
        return token

    def step(self) -> int:
        return self.sample(self.forward())


def _raise_failed(engine: LLMEngine, request_id: str, error: str | None):
    """The offline front raises what the engine isolated (the engine itself went on)."""
    raise WorkbenchError(f"request {request_id} failed: {error}") from engine.last_step_error


def reference_generate(model: CausalLM, prompt_ids: list[int], max_new_tokens: int,
                       params: SamplingParams | None = None) -> list[int]:
    """``max_new_tokens`` tokens by the bare loop (no EOS or stop checks, no metrics)."""
    loop = ReferenceLoop(model, prompt_ids, max_new_tokens, params)
    return [loop.step() for _ in range(max_new_tokens)]


class LLM:
    """Offline front over one :class:`~workbench.engine.core.LLMEngine`.

    ``LLM(model, config)``: ``model`` a path, ``"preset:<name>"``, None for the bundled model, or a
    loaded CausalLM; ``config`` an :class:`~workbench.engine.config.EngineConfig` (default: the
    reference configuration).  Or ``LLM(model, **options)``: the config's parts by keyword, as
    below (:meth:`~workbench.engine.config.EngineConfig.from_options`; an unknown one is refused).
    ``tokenizer``: a folder / tokenizer.json path, a :class:`Tokenizer`, or None to use the
    model folder's (presets have none: pass prompts as token-id lists).
    ``kv``: None for a contiguous cache per request (the reference), or a
    :class:`~workbench.kv.paged.PagedKVConfig` for a paged pool shared by all requests, with
    cross-request prefix caching when ``enable_prefix_caching`` is set (and its offload tier).
    ``tiers`` (+ ``tier_basis``, a fitted :class:`~workbench.kv.pca.PCABasis`): each request
    gets a hot / warm / cold :class:`~workbench.kv.tiers.TieredKVCache` (approximate attention;
    the model's attention modules are switched to the tiered policy in place); add ``tier_store``
    (a :class:`~workbench.kv.tiers_physical.TierStore`) for the physical cache, whose warm and
    cold tokens' full K/V live in an offload tier (host memory or disk) and come back through
    the prefetcher when routing selects them.
    ``scheduler``: None for one request at a time (:func:`reference_scheduler`), or a
    :class:`~workbench.sched.SchedulerConfig` for continuous batching.
    ``threads``: torch's intra-op thread count on a CPU: an integer, or None / ``"auto"`` to
    measure decode steps of this model with each candidate count and take the fewest threads
    within 15 % of the fastest (:mod:`workbench.measure.threads`; ``WORKBENCH_THREADS`` in the
    environment overrides the measurement).  The choice is in :attr:`thread_choice` and in
    every request's metrics.  It is process-wide, as torch's setting is.
    ``static_decode`` / ``compile`` / ``cuda_graphs``: decode steps on static buffers (eager),
    ``torch.compile``'d (on a CPU, inductor's C++ for the whole step) and/or captured as CUDA
    graphs per batch-size bucket
    (:class:`~workbench.engine.runners.StaticRunner` on contiguous rows, or
    :class:`~workbench.engine.runners.PagedStaticRunner` over the paged pool's blocks with ``kv=``).
    ``check_finite``: the loader refuses NaN / Inf weights unless this is False.
    ``stream_weights``: a :class:`~workbench.prefetch.weights.WeightStreamConfig` (some decoder
    layers resident, the rest fetched ahead of use from disk or host memory; a quantized model
    streams its quantized bytes, and its backend's repacked copies, as stored).
    ``quant``: a :class:`~workbench.quant.recipe.QuantRecipe`, its string (``"w4a16:g128"``,
    ``"w4a16:g128:awq"``, ``"w8a8:smooth=0.5"``) or a recipe file's path (``"recipe.json"``, as
    ``workbench calibrate-quant`` writes it: a per-layer mix, calibrated on the text the file
    names unless ``quant_calibration`` is given): the linear layers quantized in place
    (:func:`workbench.quant.apply.quantize_model`).  ``quant_calibration``: token-id sequences
    for AWQ / GPTQ / SmoothQuant (default: 8 windows of 512 tokens from the calibration half of
    the bundled held-out corpus, :func:`workbench.data.heldout_split`).  ``quant_backend``: how
    the quantized layers compute (:func:`workbench.quant.apply.set_quant_backend`: ``auto`` =
    torch's packed CPU ops on a CPU, the Triton kernels on a GPU; ``reference`` = dequantize,
    then matmul); layers a backend cannot run keep the reference.  A ``model`` folder holding a
    compressed-tensors ``pack-quantized`` checkpoint (``workbench quantize`` writes them; the format
    vLLM and transformers read) loads quantized as stored (:func:`workbench.quant.compressed.load_compressed`,
    ``model.recipe`` set); its layers go on ``quant_backend`` and ``quant=`` is refused.
    ``max_model_len``: the context served (default the model's); above the model's
    ``max_position_embeddings`` it is a ConfigError naming both (never clamped).
    ``memory_budget``: bytes (``"8G"``, ``"512M"``) the engine's KV pool, caches and static buffers may
    take (see :class:`~workbench.engine.core.LLMEngine`); they are computed from the model's config
    and refused in one line before the weights load when they do not fit the budget or the machine.
    """

    def __init__(self, model: str | CausalLM | None = None, config: EngineConfig | None = None, **options) -> None:
        config = EngineConfig.from_options(config, who="LLM", **options)
        # before the load (a mistake costs no time or memory), with the device the loader will choose
        device = None if isinstance(model, CausalLM) else resolve_device(config.load.device)
        config.check("LLM", model=model, device=device)
        config.memory_budget = parse_bytes(config.memory_budget, "LLM(memory_budget=...)")
        # the engine's sizes from the config alone: a pool or cache that cannot fit is refused before the load
        load, q = config.load, config.quant
        check_before_loading(model, load.device, load.dtype, max_model_len=load.max_model_len,
                             **config.memory_args(config.scheduler or SchedulerConfig(max_num_seqs=1)))
        self.loaded = LoadedModel.load(model, **load.as_kwargs())
        if q.recipe is not None:     # weights quantized in place (a model object passed in is changed too)
            self._quantize(q.recipe, q.calibration, q.backend)
        elif is_compressed(model):   # loaded quantized: only where the layers compute is chosen here
            self.quant_placement = set_quant_backend(self.loaded.model, q.backend)
        self.config = config
        self.engine = LLMEngine(self.loaded, replace(config, load=LoadOptions()))
        self._queues: dict[str, deque] = {}      # live stream id -> its events not yet yielded

    def _quantize(self, quant, calibration, backend: str) -> None:
        recipe, doc = resolve_recipe(quant)          # a QuantRecipe, a scheme string or a recipe file
        if recipe.needs_calibration and calibration is None and (doc or {}).get("calibration"):
            if self.loaded.tokenizer is None:
                raise ConfigError(f"LLM: the recipe file {quant} calibrates on text and this model has no tokenizer")
            try:
                calibration = windows_from_spec(doc["calibration"], self.loaded.tokenizer)   # the recipe's own text
            except DataError as e:
                raise DataError(f"{quant}: field 'calibration': {e}") from None
        if recipe.needs_calibration and calibration is None:
            if self.loaded.tokenizer is None:
                raise ConfigError(f"LLM: {recipe.name} reads activations and this model has no tokenizer; "
                                  "pass quant_calibration=[token id lists]")
            calibration = heldout_split(self.loaded.tokenizer, min(512, self.loaded.max_model_len))["calibration"][:8]
        try:
            quantize_model(self.loaded.model, recipe, calibration=calibration)
        except ConfigError as e:         # e.g. a layer name the recipe file gives that this model lacks
            if doc is None:
                raise
            raise ConfigError(f"{quant}: {e}") from None
        self.quant_placement = set_quant_backend(self.loaded.model, backend)

    # ---- what was loaded ---------------------------------------------------------------------
    model = property(lambda self: self.loaded.model)
    tokenizer = property(lambda self: self.loaded.tokenizer)
    max_model_len = property(lambda self: self.loaded.max_model_len)

    @property
    def eos_token_ids(self) -> set:
        return self.loaded.eos_token_ids

    @eos_token_ids.setter
    def eos_token_ids(self, ids) -> None:        # requests added from now on stop on these
        self.loaded.eos_token_ids = set(ids)
    thread_choice = property(lambda self: self.loaded.thread_choice)
    tiers = property(lambda self: self.engine.tiers)
    tier_basis = property(lambda self: self.engine.tier_basis)
    tier_store = property(lambda self: self.engine.tier_store)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def threads(self) -> int:
        """The intra-op thread count this engine chose (``thread_choice`` says why)."""
        return self.loaded.threads

    @property
    def kv_pool(self):
        """The paged KV pool (None when KV lives in a cache per request)."""
        return self.engine.kv_pool

    @property
    def active_caches(self) -> dict:
        """Request id -> its live per-request cache (contiguous or tiered KV)."""
        return self.engine.active_caches

    @property
    def last_cache(self):
        """The per-request cache of the request that ended last (kv-inspect reads tiered zones)."""
        return self.engine.last_cache

    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        return self.loaded.encode(prompt)

    # ---- generation --------------------------------------------------------------------------
    def _route(self, events: list[StreamEvent]) -> None:
        for ev in events:
            q = self._queues.get(ev.request_id)
            if q is not None:
                q.append(ev)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, arrival_time: float | None = None,
               output: RequestOutput | None = None) -> Iterator[StreamEvent]:
        """Generate one request, yielding each token as soon as its id is on the host.  Other
        streams of this LLM may be open at the same time: each gets only its own events."""
        eng = self.engine
        rid = eng.add_request(prompt, params, arrival_time=arrival_time, output=output)
        q = self._queues[rid] = deque()
        done = False
        try:
            while True:
                while not q:
                    self._route(eng.step())
                ev = q.popleft()
                if ev.finish_reason == "error":
                    done = True
                    _raise_failed(eng, ev.request_id, ev.error)
                yield ev
                if ev.finished:
                    done = True
                    return
        finally:   # also when the caller stops iterating: the request ends, its KV is freed
            del self._queues[rid]
            if not done:
                eng.abort(rid, "the caller stopped reading the stream")
                self._route(eng.drain_events())
            eng.release(rid)

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Add every prompt (all arrive now), step until all are done.  One at a time in the
        reference configuration, so a later request's TTFT includes the time it waited."""
        outs = self.engine.generate(prompts, params, use_tqdm=use_tqdm,
                                    on_events=self._route)    # open streams of this LLM get theirs
        failed = next((o for o in outs if o.finish_reason == "error"), None)
        if failed is not None:
            _raise_failed(self.engine, failed.request_id, failed.error)
        return outs

    @contextmanager
    def batching(self, max_num_seqs: int):
        """Let up to ``max_num_seqs`` requests run together for the duration (e.g. interleaved
        streams that should hold their KV at the same time); the configuration comes back on exit."""
        cfg = self.engine.scheduler.config
        before = cfg.max_num_seqs
        cap = getattr(self.engine.runner, "max_seqs", None)
        if cap is not None and max_num_seqs > cap:
            raise ConfigError(f"LLM.batching({max_num_seqs}): the static decode buffers of this engine were built for "
                              f"{cap} sequence(s); build it with scheduler=SchedulerConfig(max_num_seqs=...)")
        cfg.max_num_seqs = max(before, int(max_num_seqs))
        try:
            yield self
        finally:
            cfg.max_num_seqs = before

    # ---- summaries ---------------------------------------------------------------------------
    summarize = staticmethod(summarize)
    requests_frame = staticmethod(requests_frame)
