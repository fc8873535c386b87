"""The model side of the engine: one forward over every scheduled token of a step.

Both runners call the model itself, ``model(tokens, ..., cache=...)``, so every step goes
through ``DecoderLayer.forward`` and whatever transformations the model carries (per-op
backends and the fused add + RMSNorm, tiered attention, later quantized layers).  They differ
only in the cache they hand it (the interface of :mod:`workbench.model.kv_cache`):

* :class:`ModelRunner` - the paged pool.  All tokens of a step (prefill chunks and decode
  tokens of many sequences) are packed into one ``[1, N]`` row with their positions; a
  :class:`~workbench.kv.batch.PagedBatchCache` writes each token's K/V to its slot and lets
  every sequence attend over its own blocks.
* :class:`ContiguousRunner` - one cache per sequence: a contiguous
  :class:`~workbench.model.kv_cache.KVCache` (the reference), or a
  :class:`~workbench.kv.tiers.TieredKVCache` with tiers.  With one sequence per step (the
  reference configuration) a step is exactly ``model(ids, start, cache, logits_to_keep=1)``;
  a packed step goes through a :class:`~workbench.kv.batch.SequenceBatchCache`.

**Batch invariance.**  Continuous batching must not change what a request generates: the
same greedy tokens alone, in a batch, with chunked prefill or after preemption.  Two things
break that on a CPU in float32 (measured in the scheduler notebook):

* a matrix multiply with few rows (M < 16) takes a different kernel than with many, so the
  same row gets a different rounding - fixed here by padding packed steps to at least
  ``MIN_ROWS`` rows, which keeps every row on the same kernel;
* attention's reductions run over a length that depends on padding and chunking - fixed in
  the paged batch by computing attention in float64 (:mod:`workbench.kv.batch`); per-sequence
  caches attend each sequence alone, so their reductions do not depend on the batch.

Both cost time, so ``batch_invariant=False`` switches them off (plain SDPA, no padding) for
speed studies; on a GPU in bf16 it is off by default.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from workbench.engine.sizing import static_buckets
from workbench.errors import ConfigError
from workbench.kv.batch import PagedBatchCache, SequenceBatchCache
from workbench.kv.paged import PagedKVPool, PagedSequenceCache
from workbench.model.decoder import CausalLM
from workbench.sched.scheduler import ScheduledSeq, SwapIn, SwapOut
from workbench.transforms.paged_graphs import PagedDecoder
from workbench.transforms.cuda_graphs import GraphedDecoder

if TYPE_CHECKING:
    from workbench.engine.caches import CacheFactory

MIN_ROWS = 16


def default_batch_invariant(model: CausalLM, batch_invariant: bool | None) -> bool:
    if batch_invariant is not None:
        return batch_invariant
    return model.device.type == "cpu" and model.lm_head.weight.dtype == torch.float32


class _Packed:
    """The step's tokens in one row: ids and positions (padded), and the rows whose logits are
    wanted (``ScheduledSeq.logit_rows`` per sequence, in order; padded too, for batch invariance)."""

    def __init__(self, scheduled: list[ScheduledSeq], pad_to: int, device) -> None:
        tokens, positions, last = [], [], []
        for s in scheduled:
            end = s.start + s.num_tokens
            tokens += s.seq.tokens[s.start:end]
            positions += range(s.start, end)
            k = s.logit_rows                       # the chunk's last k rows (k = 1: the row that samples)
            last += range(len(tokens) - k, len(tokens))
        self.num_tokens, self.num_logits = len(tokens), len(last)
        self.max_position = max(positions, default=0)
        pad = max(0, pad_to - len(tokens))
        self.rows = len(tokens) + pad
        self.ids = torch.tensor([tokens + [0] * pad], device=device)
        self.positions = torch.tensor(positions + [0] * pad, device=device)
        if last and len(last) < pad_to:                  # the LM head is a matmul too
            last += [last[0]] * (pad_to - len(last))
        self.logits_rows = torch.tensor(last, dtype=torch.long, device=device)


def custom_runner(runner, pool: PagedKVPool):
    """What ``LLMEngine(..., runner=...)`` runs on: ``runner`` itself when it is a runner (it has
    ``execute``), else ``runner(pool)`` - a runner made for the engine's paged pool (a fake one
    that reads the block tables: ``runner=lambda pool: FakeRunner(pool.manager)``)."""
    if hasattr(runner, "execute") and not isinstance(runner, type):
        return runner
    made = runner(pool) if callable(runner) else None
    if not hasattr(made, "execute"):
        got = type(runner).__name__ if made is None else f"a callable returning {type(made).__name__}"
        raise ConfigError(f"LLMEngine: runner= must be a runner (with execute) or a callable taking the pool "
                          f"and returning one, got {got}")
    return made


class Runner(ABC):
    """A runner: the step's forward (``execute``: logits [k, vocab] for the sequences that sample,
    in order), and the KV copies of preemption by swapping (``swap_out`` / ``swap_in``, and
    ``drop_swap`` when a request ends).  This base runs a step the two ways every runner shares -
    ``direct`` (one sequence per step: the reference call ``model(ids, start, cache,
    logits_to_keep=k)``) or packed (all tokens in one row, padded for batch invariance) - over
    the cache a subclass hands it; its KV is not swappable (per-sequence caches)."""

    def __init__(self, model: CausalLM, pool: PagedKVPool, direct: bool, batch_invariant: bool | None) -> None:
        self.model, self.pool, self.direct = model, pool, direct
        self.device = model.device
        self.batch_invariant = default_batch_invariant(model, batch_invariant)

    @abstractmethod
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run the step; returns logits [k, vocab] for the sequences that sample (in order)."""

    def swap_out(self, s: SwapOut) -> None:
        raise ConfigError("per-sequence KV caches are not swapped; use preemption_mode='recompute'")

    def swap_in(self, s: SwapIn) -> None:
        self.swap_out(s)

    def drop_swap(self, request_id: str) -> None:
        """``request_id`` ended: whatever was kept for it while swapped out goes (here: nothing)."""
        return

    def _forward(self, scheduled: list[ScheduledSeq], direct_cache, batch_cache) -> torch.Tensor:
        """The step over the runner's caches: ``direct_cache()`` for the reference call (``direct``,
        one sequence), else one packed forward over ``batch_cache(packed)``."""
        if self.direct and len(scheduled) == 1:
            # one sequence's chunk as the reference call model(ids, start, cache, logits_to_keep=k): logits of
            # its last s.logit_rows positions
            s = scheduled[0]
            ids = torch.tensor([s.seq.tokens[s.start:s.start + s.num_tokens]], device=self.device)
            k = s.logit_rows
            logits = self.model(ids, s.start, direct_cache(), logits_to_keep=max(k, 1))[0]
            return logits[logits.shape[0] - k:]
        p = _Packed(scheduled, MIN_ROWS if self.batch_invariant else 0, self.device)
        logits = self.model(p.ids, cache=batch_cache(p), positions=p.positions, logits_rows=p.logits_rows,
                            max_position=p.max_position)
        return logits[:p.num_logits]


class StaticSteps:
    """Static decode steps for a runner (mixed in before it): ``decoder`` (a static decoder made
    for the batch-size buckets 1, 2, 4, ... up to ``max_seqs``, ``torch.compile``'d with
    ``compile``, captured per bucket with ``cuda_graphs``) runs a step whose rows are all one
    token; a step with a longer prompt chunk runs as the runner underneath runs it, in one eager
    forward (``static_steps`` / ``eager_steps`` count them)."""

    def _build_static(self, make_decoder, max_seqs: int, compile: bool, cuda_graphs: bool) -> None:
        """``make_decoder(buckets)`` -> the static decoder; compiled and captured here."""
        self.max_seqs = max_seqs
        self.decoder = make_decoder(tuple(static_buckets(max_seqs)))
        self.static_steps = self.eager_steps = 0       # how the steps ran (the engine's breakdown reads them)
        if compile:
            self.decoder.compile()
        if cuda_graphs:
            self.decoder.capture(strict=True)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        if any(s.num_tokens > 1 for s in scheduled):
            # a prompt chunk: the whole step, decode rows included, in one eager forward (one read of the
            # weights, not one forward per prompt and a static call for the decode rows)
            self.eager_steps += 1
            return super().execute(scheduled)
        self.static_steps += 1
        return self._static_step(scheduled)

    def _static_step(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """One static call for a step of one-token rows."""
        raise NotImplementedError


class ModelRunner(Runner):
    """Packed steps over the paged pool (and swap copies for preemption by swapping).  ``direct``
    (one sequence per step, the LLM front's default): a step is ``model(ids, start,
    PagedSequenceCache, logits_to_keep=1)``, the reference call over the sequence's blocks -
    nothing to pad, no batch to be invariant to."""

    def __init__(self, model: CausalLM, pool: PagedKVPool, batch_invariant: bool | None = None,
                 direct: bool = False) -> None:
        super().__init__(model, pool, direct, batch_invariant)
        cfg = model.config
        self.nkv, self.hd = cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.swap_space: dict[str, torch.Tensor] = {}   # seq id -> KV [L, 2, n, nkv, hd] on the host

    # ---- preemption by swapping ------------------------------------------------------------
    def _gather(self, block_table: list[int], start: int, end: int, layer: int):
        B = self.pool.block_size
        slots = torch.tensor([block_table[p // B] * B + p % B for p in range(start, end)], dtype=torch.long,
                             device=self.device)                 # long even when empty: an index, not floats
        k = self.pool.k_cache[layer].view(-1, self.nkv, self.hd)
        v = self.pool.v_cache[layer].view(-1, self.nkv, self.hd)
        return slots, k, v

    def swap_out(self, s: SwapOut) -> None:
        store = self.pool.swap_store
        if store is not None:     # PagedKVConfig.swap_space: block by block into a transport's tier
            nblk = -(-s.num_tokens // self.pool.block_size)
            store.put(s.seq.request_id, self.pool.read_blocks(s.block_table[:nblk]))
            return
        layers = []
        for layer in range(len(self.pool.k_cache)):
            slots, k, v = self._gather(s.block_table, 0, s.num_tokens, layer)
            layers.append(torch.stack((k[slots], v[slots])))
        kv = torch.stack(layers)
        if kv.device.type == "cuda":
            # straight into pinned memory (one copy, not a pageable one and then a second to pin it);
            # the swap-in's non-blocking copy back is then a DMA the host only enqueues
            host = torch.empty(kv.shape, dtype=kv.dtype, pin_memory=True)
            host.copy_(kv, non_blocking=True)
            torch.cuda.current_stream(kv.device).synchronize()     # the bytes are on the host now
        else:
            host = kv
        self.swap_space[s.seq.request_id] = host

    def swap_in(self, s: SwapIn) -> None:
        rid, store = s.seq.request_id, self.pool.swap_store
        if store is not None:     # staged blocks when the lookahead started them, else fetched now
            B = self.pool.block_size
            first, last = s.num_cached // B, max(s.num_cached // B, -(-s.num_tokens // B))
            saved, offset = store.take(rid, first, last, self.device), first * B
        else:
            saved, offset = self.swap_space.pop(rid).to(self.device, non_blocking=True), 0
        table = self.pool.manager.block_table(rid)
        for layer in range(len(self.pool.k_cache)):
            slots, k, v = self._gather(table, s.num_cached, s.num_tokens, layer)
            k[slots] = saved[layer, 0, s.num_cached - offset:s.num_tokens - offset]
            v[slots] = saved[layer, 1, s.num_cached - offset:s.num_tokens - offset]

    def drop_swap(self, request_id: str) -> None:
        """``request_id`` ended: its swapped KV and anything staged for it go."""
        self.swap_space.pop(request_id, None)
        if self.pool.kv_prefetch is not None:
            self.pool.kv_prefetch.drop_request(request_id)
        if self.pool.swap_store is not None:
            self.pool.swap_store.drop(request_id)

    # ---- the forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run the step; returns logits [k, vocab] for the sequences that sample (in order)."""
        return self._forward(
            scheduled, lambda: PagedSequenceCache(self.pool, scheduled[0].seq.request_id, scheduled[0].start),
            lambda p: PagedBatchCache(self.pool, [(s.seq.request_id, s.start, s.num_tokens) for s in scheduled],
                                      p.rows, self.batch_invariant, self.window))


class PagedStaticRunner(StaticSteps, ModelRunner):
    """The paged pool with static decode steps (:class:`~workbench.transforms.paged_graphs.PagedDecoder`):
    a step whose rows are all one token (decode tokens, and one-token prompt chunks) is one static
    call over the pool, ``torch.compile``'d (``compile``) and/or replayed from a CUDA graph per
    batch-size bucket (``cuda_graphs``).  A step with a longer prompt chunk runs as
    :class:`ModelRunner` runs it - the whole step, decode rows included, in one eager forward -
    as serving engines run mixed batches outside their graphs: splitting it into a prefill
    forward and a static decode call would read every weight twice, which on a CPU (where a step
    is bound by reading the weights) costs more than the static call saves.  Everything else the
    pool does is the block manager's and is unchanged: prefix sharing, offload and its lookahead,
    copy-on-write for forks, preemption by recompute or swap (the swap copies are
    :class:`ModelRunner`'s).

    Attention over the pool reduces over each row's own blocks (padded, masked), not in the
    reference's order: greedy tokens agree, they are not bitwise guaranteed (measured against
    the eager pool in the tests and by ``workbench bench``)."""

    def __init__(self, model: CausalLM, pool: PagedKVPool, max_len: int, max_seqs: int,
                 compile: bool = False, cuda_graphs: bool = False) -> None:
        super().__init__(model, pool, batch_invariant=False, direct=max_seqs == 1)
        self._build_static(lambda buckets: PagedDecoder(model, pool, -(-max_len // pool.block_size), buckets),
                           max_seqs, compile, cuda_graphs)

    def _static_step(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        m = self.pool.manager
        step = self.decoder.decode([s.seq.tokens[s.start] for s in scheduled], [s.start for s in scheduled],
                                   [m.block_table(s.seq.request_id) for s in scheduled])
        keep = [i for i, s in enumerate(scheduled) if s.logit_rows]
        if len(keep) == len(scheduled):
            return step
        return step[keep] if keep else step[:0]


class ContiguousRunner(Runner):
    """Steps over one cache per sequence, made by ``caches`` (a
    :class:`~workbench.engine.caches.CacheFactory`: ``caches.make(max_len)``) when a sequence is
    first scheduled and dropped when its blocks are freed (it finished, was aborted or was
    preempted by recompute).  ``pool``: the engine's block accounting (no tensors), whose
    listeners tell this runner when a sequence ends.  ``direct``: one sequence per step runs
    the reference call ``model(ids, start, cache, logits_to_keep=1)`` (the reference
    configuration); otherwise steps are packed (padded for batch invariance)."""

    def __init__(self, model: CausalLM, pool: PagedKVPool, caches: CacheFactory | None, direct: bool = True,
                 batch_invariant: bool | None = None) -> None:
        super().__init__(model, pool, direct, batch_invariant)
        self.cache_factory = caches
        self.caches: dict[str, object] = {}   # live sequence id -> its cache
        self.last_cache = None                # the last ended sequence's cache, when the factory keeps it
        pool.listeners.append(self._on_pool_event)

    def _on_pool_event(self, event: str, seq_id: str) -> None:
        if event == "end" and seq_id in self.caches:
            cache, factory = self.caches.pop(seq_id), self.cache_factory
            if factory.keep_last:       # the previous last cache is done with (inspectors read the newest)
                factory.finish(cache)
                cache, self.last_cache = self.last_cache, cache
            if cache is not None:
                factory.release(cache)

    def _cache(self, s: ScheduledSeq):
        rid = s.seq.request_id
        cache = self.caches.get(rid)
        if cache is None:
            cache = self.caches[rid] = self.cache_factory.make(s.seq.prompt_len + s.seq.max_new)
        return cache

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        caches = [self._cache(s) for s in scheduled]
        logits = self._forward(scheduled, lambda: caches[0], lambda p: SequenceBatchCache(
            [(c, s.start, s.num_tokens) for c, s in zip(caches, scheduled)]))
        if not (self.direct and len(scheduled) == 1):
            for c, s in zip(caches, scheduled):
                c.length = s.start + s.num_tokens
        return logits


class StaticRunner(StaticSteps, ContiguousRunner):
    """Decode steps on static buffers (:class:`~workbench.transforms.cuda_graphs.GraphedDecoder`): one
    contiguous cache row per running sequence, rows kept packed (a sequence that ends hands its
    row to the last one).  ``compile``: the static step is ``torch.compile``'d (on a CPU,
    inductor's C++); ``cuda_graphs``: captured once per batch-size bucket and replayed.
    A step of one-token rows (decode) is one static call; a step with a longer prompt chunk runs
    eagerly, all its sequences packed in one forward over their rows (as :class:`PagedStaticRunner`
    does, and for the same reason).  Attention in the static call spans the whole row with a mask,
    so the reduction length differs from the reference: greedy tokens agree, they are not bitwise
    guaranteed.

    Cost: the buffers hold ``max_seqs + 1`` rows of ``max_len`` tokens and every decode step
    attends over whole rows, so both grow with the engine's ``max_model_len`` (set it to what
    requests need: ``LLM(..., max_model_len=...)``, ``--max-model-len``).  The batch-size buckets
    are fixed here: more running sequences than ``max_seqs`` is refused."""

    def __init__(self, model: CausalLM, pool: PagedKVPool, max_len: int, max_seqs: int,
                 compile: bool = False, cuda_graphs: bool = False) -> None:
        self._build_static(lambda buckets: GraphedDecoder(model, max_len, buckets), max_seqs, compile, cuda_graphs)
        super().__init__(model, pool, caches=None, direct=True, batch_invariant=False)
        self.rows: dict[str, int] = {}        # live sequence id -> its cache row (0..n-1)

    def _on_pool_event(self, event: str, seq_id: str) -> None:
        if event != "end" or seq_id not in self.rows:
            return
        row, last = self.rows.pop(seq_id), len(self.rows)
        if row != last:                       # keep rows packed: the last sequence moves into the gap
            moved = next(r for r, i in self.rows.items() if i == last)
            self.decoder.move_row(last, row)
            self.rows[moved] = row

    def _cache(self, s: ScheduledSeq):
        """The sequence's cache row as a contiguous cache of its own (views: writes land in the row)."""
        view = self.decoder.kv.row(self.rows[s.seq.request_id])
        view.length = s.start
        return view

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        for s in scheduled:
            if s.seq.request_id not in self.rows:
                self.rows[s.seq.request_id] = len(self.rows)
        return super().execute(scheduled)

    def _static_step(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        tokens: list = [None] * len(self.rows)          # row i decodes tokens[i]; None: row i sits this step out
        positions = [0] * len(self.rows)
        for s in scheduled:
            row = self.rows[s.seq.request_id]
            tokens[row], positions[row] = s.seq.tokens[s.start], s.start
        step = self.decoder.decode(tokens, positions)
        keep = [self.rows[s.seq.request_id] for s in scheduled if s.samples]
        return step[keep] if keep else step[:0]
