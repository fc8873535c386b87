"""The reference engine: one request at a time, contiguous KV cache, plain PyTorch.

This is the baseline every later layer (paged KV, fused kernels, continuous batching) is
measured against, so it is deliberately simple and exact::

    llm = LLM()                                     # the bundled model
    out = llm.generate(["The list type"], SamplingParams(temperature=0, max_tokens=32))
    for ev in llm.stream("The list type", SamplingParams(max_tokens=8)):
        print(ev.text, ev.time)

A generation step is ``model(new_tokens, start_pos, cache, logits_to_keep=1)`` followed by
:func:`workbench.sampling.sample`; prefill is the same call over the whole prompt.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from .engine_types import RequestOutput, StreamEvent
from .errors import ConfigError, WorkbenchError
from .loader import BUNDLED_MODEL, load_model
from .metrics import RequestMetrics, requests_frame, summarize
from .model import CausalLM
from .output import OutputProcessor
from .sampling import SamplingParams, sample
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .kv.paged import PagedKVConfig
    from .kv.tier_config import TierConfig

Prompt = str | Sequence[int]


class LLM:
    """Offline engine over a :class:`CausalLM` and its tokenizer.

    ``model``: a path, ``"preset:<name>"``, None for the bundled model, or a loaded CausalLM.
    ``tokenizer``: a folder / tokenizer.json path, a :class:`Tokenizer`, or None to use the
    model folder's (presets have none: pass prompts as token-id lists).
    ``kv``: None for a contiguous cache per request (the reference), or a
    :class:`~workbench.kv.paged.PagedKVConfig` for a paged pool shared by all requests, with
    cross-request prefix caching when ``enable_prefix_caching`` is set.
    ``tiers`` (+ ``tier_basis``, a fitted :class:`~workbench.kv.pca.PCABasis`): each request
    gets a hot / warm / cold :class:`~workbench.kv.tiers.TieredKVCache` (approximate attention;
    the model's attention modules are switched to the tiered path in place).
    ``threads``: torch's intra-op thread count on a CPU: an integer, or None / ``"auto"`` to
    measure decode steps of this model with each candidate count and take the fewest threads
    within 15 % of the fastest (:mod:`workbench.measure.threads`; ``WORKBENCH_THREADS`` in the
    environment overrides the measurement).  The choice is in :attr:`thread_choice` and in
    every request's metrics.  It is process-wide, as torch's setting is.
    """

    def __init__(self, model: str | CausalLM | None = None, tokenizer=None, device=None, dtype=None,
                 max_model_len: int | None = None, kv: "PagedKVConfig | None" = None,
                 tiers: "TierConfig | None" = None, tier_basis=None, threads: int | str | None = None) -> None:
        from .measure.threads import apply_thread_policy, parse_threads

        parse_threads(threads, where="LLM(threads=...)")    # bad input fails before a model loads
        if isinstance(model, CausalLM):
            self.model, source = model, None
        else:
            self.model = load_model(model, device=device, dtype=dtype)
            source = BUNDLED_MODEL if model in (None, "bundled") else model
        # torch's intra-op threads (process-wide): measured on this model unless given
        self.thread_choice = apply_thread_policy(self.model, threads)
        if isinstance(tokenizer, Tokenizer):
            self.tokenizer = tokenizer
        elif tokenizer is not None:
            self.tokenizer = Tokenizer(tokenizer)
        elif source is not None and not str(source).startswith("preset:"):
            self.tokenizer = Tokenizer(source)
        else:
            self.tokenizer = None
        limit = self.model.config.max_position_embeddings
        self.max_model_len = min(max_model_len or limit, limit)
        eos = self.model.config.eos_token_id
        cfg_eos = set(eos) if isinstance(eos, list) else ({eos} if eos is not None else set())
        self.eos_token_ids = self.tokenizer.eos_token_ids if self.tokenizer else cfg_eos
        self._ids = itertools.count()
        self.kv_pool = None
        # request id -> its live cache (tiered mode), and the last finished one, for kv-inspect
        self.active_caches: dict = {}
        self.last_cache = None
        self.tiers, self.tier_basis = tiers, tier_basis
        if tiers is not None:   # hot / warm / cold KV per request
            if kv is not None:
                raise ConfigError("LLM: give kv= (paged pool) or tiers= (tiered cache), not both")
            from .kv.tiers import TieredKVCache, apply_tiered_attention

            TieredKVCache(self.model.config, tiers, tier_basis, max_len=1)   # validate now, not per request
            apply_tiered_attention(self.model)   # other caches keep the reference path
        if kv is not None:  # paged KV with an optional cross-request prefix cache
            from .kv.paged import PagedKVPool

            w = self.model.lm_head.weight
            # default pool: room for four full-context sequences
            self.kv_pool = PagedKVPool(self.model.config, kv, w.device, w.dtype, default_tokens=4 * self.max_model_len)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def threads(self) -> int:
        """The intra-op thread count this engine chose (``thread_choice`` says why)."""
        return self.thread_choice.threads

    # ---- prompts -----------------------------------------------------------------------------
    def encode(self, prompt: Prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise WorkbenchError("this model has no tokenizer (a shape preset?): pass prompts as lists of "
                                     "token ids, or give LLM(..., tokenizer=<folder>)")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
            prompt = None
        vocab = self.model.config.vocab_size
        if not ids:
            raise ConfigError("prompt is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ConfigError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ConfigError(f"prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                              "(leave room for at least one generated token)")
        return prompt, ids

    # ---- generation --------------------------------------------------------------------------
    @torch.inference_mode()
    def stream(self, prompt: Prompt, params: SamplingParams | None = None, arrival_time: float | None = None,
               output: RequestOutput | None = None) -> Iterator[StreamEvent]:
        """Generate one request, yielding each token as soon as its id is on the host."""
        params = params or SamplingParams()
        arrival = time.perf_counter() if arrival_time is None else arrival_time
        text_prompt, ids = self.encode(prompt)
        out = output or RequestOutput(request_id="", prompt=None, prompt_token_ids=[])
        out.request_id = out.request_id or f"req-{next(self._ids)}"
        out.prompt, out.prompt_token_ids = text_prompt, ids
        m = out.metrics = RequestMetrics(arrival_time=arrival, prompt_tokens=len(ids),
                                         threads=torch.get_num_threads())
        m.first_scheduled_time = time.perf_counter()

        max_new = min(params.max_tokens, self.max_model_len - len(ids))
        rid = out.request_id
        if self.tiers is not None:
            from .kv.tiers import TieredKVCache

            w = self.model.lm_head.weight
            cache, pos = TieredKVCache(self.model.config, self.tiers, self.tier_basis, max_len=len(ids) + max_new,
                                       device=w.device, dtype=w.dtype), 0
            self.active_caches[rid] = cache
        elif self.kv_pool is None:
            cache, pos = self.model.new_cache(1, len(ids) + max_new), 0
        else:
            cache, alloc = self.kv_pool.begin(rid, ids)
            pos = out.num_cached_tokens = alloc.num_cached_tokens
            out.prefix_miss_reason = _reason_name(alloc.miss_reason)
        try:
            yield from self._decode_loop(out, ids, pos, cache, max_new, params, arrival)
        finally:  # also when the caller stops iterating: the blocks go back to the pool
            if self.kv_pool is not None:
                self.kv_pool.end(rid)
            if rid in self.active_caches:
                self.last_cache = self.active_caches.pop(rid)

    def _decode_loop(self, out: RequestOutput, ids: list[int], pos: int, cache, max_new: int,
                     params: SamplingParams, arrival: float) -> Iterator[StreamEvent]:
        rid, pool = out.request_id, self.kv_pool
        gen = params.generator(self.device)
        proc = OutputProcessor(out, params, self.tokenizer, self.eos_token_ids, max_new)
        x = torch.tensor([ids[pos:]], device=self.device)   # after a prefix hit: only the rest
        while True:
            logits = self.model(x, pos, cache, logits_to_keep=1)[0, -1]
            token = int(sample(logits, params, gen))   # .item(): waits for the device
            pos += x.shape[1]
            if pool is not None:
                pool.commit(rid, pos)
            event = proc.push(token, time.perf_counter())
            yield event
            if event.finished:
                return
            if pool is not None:
                pool.reserve(rid, token)
            x = torch.tensor([[token]], device=self.device)

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run each prompt to completion, one after another.  All requests arrive at the call,
        so a later request's TTFT includes the time it waited for the earlier ones."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        plist = params if isinstance(params, (list, tuple)) else [params or SamplingParams()] * len(prompts)
        if len(plist) != len(prompts):
            raise ConfigError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        arrival = time.perf_counter()
        outputs = []
        it = zip(prompts, plist)
        if use_tqdm:
            from tqdm.auto import tqdm
            it = tqdm(it, total=len(prompts), desc="generate", unit="req")
        for prompt, p in it:
            out = RequestOutput(request_id=f"req-{next(self._ids)}", prompt=None, prompt_token_ids=[])
            for _ in self.stream(prompt, p, arrival_time=arrival, output=out):
                pass
            outputs.append(out)
        return outputs

    # ---- summaries ---------------------------------------------------------------------------
    summarize = staticmethod(summarize)
    requests_frame = staticmethod(requests_frame)


def _reason_name(reason) -> str | None:
    return None if reason is None else getattr(reason, "value", str(reason))
