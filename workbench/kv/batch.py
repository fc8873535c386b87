"""Caches for a *packed* step: the tokens of many sequences in one row, each at its own position.

The batched engine runs one forward per step over ``[1, N]`` tokens (prefill chunks and decode
tokens of many sequences), so every position-wise module runs once for the whole batch, through
the model's own ``DecoderLayer.forward``.  Attention is the one place that must know which
token belongs to which sequence; these caches do that behind the interface of
:mod:`workbench.model.kv_cache` (``attend(attn, q, k, v, start)`` with q ``[1, nh, N, hd]``)::

    PagedBatchCache(pool, scheduled, ...)    K/V in the paged pool: tokens go to their slots, then
                                             decode rows and prefill chunks attend in two groups
    SequenceBatchCache([(cache, start, T)])  K/V in per-sequence caches (contiguous or tiered):
                                             each sequence's rows go to its own cache's attend

Rows beyond the sequences' tokens (padding, see ``workbench.engine.runners``) get zeros.

**Batch invariance of the paged path** (``batch_invariant=True``): a sequence's result must not
depend on what else is in the step.  Attention's reductions run over a length that depends on
padding and chunking, so it is computed in float64 and rounded to the model's dtype: the
reduction order then changes only bits far below float32's precision.  With the attention
kernels of ``workbench.transforms.backends`` (``attn.ops``) the groups call ``attention_decode`` /
``attention_prefill_paged`` on the pool's layer tensors instead (float32 inside; on a GPU the
decode kernel's split count depends on the batch, so bitwise invariance is the eager path's).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from workbench.model.kv_cache import attention_ops, uses_kernel
from workbench.kv.paged import PagedKVPool
from workbench.model.decoder import reference_attention


class PagedBatchCache:
    """One step over the paged pool.  ``items``: ``(seq_id, start, num_tokens)`` in row order;
    ``rows``: the packed row count (tokens plus padding)."""

    def __init__(self, pool: PagedKVPool, items: list[tuple[str, int, int]], rows: int,
                 batch_invariant: bool = False, window: int | None = None) -> None:
        self.pool, self.rows, self.batch_invariant, self.window = pool, rows, batch_invariant, window
        dev, m = pool.device, pool.manager
        slots, offset, spans = [], 0, []
        for sid, start, n in items:
            slots += m.slot_mapping(sid, start, start + n)
            spans.append((sid, start, n, offset))
            offset += n
        self.num_tokens = offset
        self.slots = torch.tensor(slots, dtype=torch.long, device=dev)
        self._slots_padded = None
        decode = [sp for sp in spans if sp[2] == 1]
        prefill = [sp for sp in spans if sp[2] > 1]
        self.groups = [_Group(self, g, one) for g, one in ((decode, True), (prefill, False)) if g]

    # ---- the attention interface (workbench.model.kv_cache) ----------------------------------------
    def kv_storage(self, layer: int):
        return self.pool.k_cache[layer], self.pool.v_cache[layer]

    def write_slots(self, B: int, start: int, T: int) -> torch.Tensor:
        """Slots of the packed rows; padding rows get -1 (the fused write skips them)."""
        if self._slots_padded is None:
            pad = torch.full((self.rows - self.num_tokens,), -1, dtype=torch.long, device=self.slots.device)
            self._slots_padded = torch.cat([self.slots, pad])
        return self._slots_padded

    def attend(self, attn, q, k, v, start: int = 0, written: bool = False) -> torch.Tensor:
        layer, n = attn.layer_idx, self.num_tokens
        qp = q[0].transpose(0, 1)                                         # [rows, nh, hd]
        if not written:
            kc, vc = self.kv_storage(layer)
            nkv, hd = kc.shape[2], kc.shape[3]
            kc.view(-1, nkv, hd)[self.slots] = k[0].transpose(0, 1)[:n]
            vc.view(-1, nkv, hd)[self.slots] = v[0].transpose(0, 1)[:n]
        packed = qp.new_zeros(qp.shape)
        ops = attention_ops(attn)
        for g in self.groups:
            g.attend(layer, qp, packed, ops)
        return packed.transpose(0, 1)[None]                               # [1, nh, rows, hd]


class _Group:
    """Sequences of one kind (decode: one query each; prefill chunks) padded to [B, T_max]
    queries and [B, S_max] keys, with a mask; a 64-token chunk in the step does not pad every
    decode row to 64 queries."""

    def __init__(self, batch: PagedBatchCache, spans, decode: bool) -> None:
        self.b, self.decode = weakref.proxy(batch), decode     # owned by the batch: no cycle keeping the pool
        pool = batch.pool
        dev, m, Bsz = pool.device, pool.manager, pool.block_size
        self.B = len(spans)
        self.T = max(n for _, _, n, _ in spans)
        self.S = max(start + n for _, start, n, _ in spans)
        nblk = -(-self.S // Bsz)
        tables = [m.block_table(sid)[:nblk] for sid, _, _, _ in spans]
        self.tables = torch.tensor([t + [t[-1]] * (nblk - len(t)) for t in tables], device=dev)   # [B, nblk]
        qrows = torch.full((self.B, self.T), -1, dtype=torch.long)            # packed row per query (-1: none)
        for i, (_, _, n, off) in enumerate(spans):
            qrows[i, :n] = torch.arange(off, off + n)
        self.qrows = qrows.to(dev)
        # the (sequence, query) pairs that are real, sequence by sequence, and their packed rows:
        # known here on the host, so no step indexes with a boolean mask (a nonzero and a
        # device->host sync per layer on a GPU)
        self.valid_b = torch.tensor([i for i, (_, _, n, _) in enumerate(spans) for _ in range(n)], device=dev)
        self.valid_t = torch.tensor([j for _, _, n, _ in spans for j in range(n)], device=dev)
        self.valid_rows = torch.tensor([off + j for _, _, n, off in spans for j in range(n)], device=dev)
        starts = torch.tensor([start for _, start, _, _ in spans], device=dev)
        self.q_lens = [n for _, _, n, _ in spans]
        self.ends = starts + torch.tensor(self.q_lens, device=dev)
        self._ends_list = [start + n for _, start, n, _ in spans]
        self._starts_list = [start for _, start, _, _ in spans]
        self._mask = self._kernel_args = None
        self._starts = starts

    def mask(self) -> torch.Tensor:
        """[B, 1, T, S]: causal, within each sequence's length and the window, made on first use."""
        if self._mask is None:
            dev, window = self.qrows.device, self.b.window
            q_pos = self._starts[:, None] + torch.arange(self.T, device=dev)[None]          # [B, T]
            k_pos = torch.arange(self.S, device=dev)
            valid_q = self.qrows >= 0
            mask = (k_pos[None, None] <= q_pos[..., None]) & (k_pos[None, None] < self.ends[:, None, None])
            if window is not None:
                mask &= k_pos[None, None] > q_pos[..., None] - window
            mask &= valid_q[..., None]
            mask[..., 0] |= ~valid_q          # padded query rows see one key: finite, then discarded
            self._mask = mask[:, None]
        return self._mask

    def kernel_args(self):
        """(query rows [n] long, block_tables [B, nblk] int32, seq_lens [B] int32, cu_seqlens_q
        [B+1] int32) for the attention kernels, made on first use and shared by every layer."""
        if self._kernel_args is None:
            dev = self.qrows.device
            rows = self.valid_rows                        # sequence by sequence, in order
            cu = torch.tensor([0] + self.q_lens, device=dev).cumsum(0).to(torch.int32)
            self._kernel_args = (rows, self.tables.to(torch.int32), self.ends.to(torch.int32), cu)
        return self._kernel_args

    def kernel(self, ops):
        """The backend entry point that attends this group, or None for the torch path below."""
        if not uses_kernel(ops, "attention_decode" if self.decode else "attention_prefill"):
            return None
        return ops.attention_decode if self.decode else ops.attention_prefill_paged

    def attend(self, layer: int, q: torch.Tensor, packed: torch.Tensor, ops=None) -> None:
        pool, window = self.b.pool, self.b.window
        kc, vc = pool.k_cache[layer], pool.v_cache[layer]                # [num_blocks, block_size, nkv, hd]
        fn = self.kernel(ops)
        if fn is not None:
            rows, tables, seq_lens, cu = self.kernel_args()
            if self.decode:
                out = fn(q[rows], kc, vc, tables, seq_lens, sliding_window=window)
            else:
                out = fn(q[rows], kc, vc, tables, cu, seq_lens, self.T, sliding_window=window)
            packed[rows] = out.to(q.dtype)
            return
        nkv, hd = kc.shape[2], kc.shape[3]
        if (not self.b.batch_invariant and kc.device.type == "cpu"
                and (not self.decode or self.B * self.S > 2 * sum(self._ends_list))):
            self._attend_each(q, packed, kc, vc)      # prompt chunks, or decode rows of very unequal lengths
            return
        if self.b.batch_invariant and kc.device.type == "cpu" and self._padding_dominates():
            self._attend_each(q, packed, kc, vc, fp64=True)
            return
        kb = kc[self.tables].reshape(self.B, -1, nkv, hd)[:, :self.S].transpose(1, 2)   # [B, nkv, S, hd]
        vb = vc[self.tables].reshape(self.B, -1, nkv, hd)[:, :self.S].transpose(1, 2)
        qb = q[self.qrows.clamp_min(0)].transpose(1, 2)                                  # [B, nh, T, hd]
        if self.b.batch_invariant:
            out = attention_fp64(qb, kb, vb, self.mask()).to(q.dtype)
        else:
            out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=self.mask(), enable_gqa=qb.shape[1] != nkv)
        rows = out.transpose(1, 2)                                                       # [B, T, nh, hd]
        packed[self.valid_rows] = rows[self.valid_b, self.valid_t]


    def _padding_dominates(self) -> bool:
        """Would padding every sequence to [T_max, S_max] cost more than twice the attention its
        rows need?  (A 488-token prompt chunk beside seven 8-token ones: 8 x 488 x 1,000 padded
        scores for 0.55 M real ones; float64 made that step 4.2 s instead of 0.15 s.)"""
        real = sum(n * end for n, end in zip(self.q_lens, self._ends_list))
        return self.B > 1 and self.B * self.T * self.S > 2 * real

    def _attend_each(self, q: torch.Tensor, packed: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
                     fp64: bool = False) -> None:
        """One sequence at a time over its own blocks (the reference attention: SDPA's causal fast path
        for a chunk from position 0).  Padding every chunk of a group to the longest chunk and the
        longest context, as the batched path does, measured 1.7x the attention time of per-sequence
        caches on a CPU (a 512-token chunk beside short prompts pads them all); decode rows are padded
        only to the longest context, which pays unless one long row (a document) pads many short ones.
        CPU only: on a GPU one SDPA launch per sequence and layer was not measured against padding.

        ``fp64``: the batch-invariant path's float64 attention per sequence, unpadded.  Its result
        rounds to the same model-dtype values as the padded one (float64 reduction order changes
        only bits far below float32's), so a sequence's tokens still do not depend on what shares
        its step; only the time spent on padding goes."""
        Bsz, nkv, hd = self.b.pool.block_size, kc.shape[2], kc.shape[3]
        window = self.b.window
        for i, (start, n) in enumerate(zip(self._starts_list, self.q_lens)):
            end = start + n
            blocks = self.tables[i, :-(-end // Bsz)]
            k = kc[blocks].reshape(-1, nkv, hd)[:end].transpose(0, 1)[None]         # [1, nkv, S, hd]
            v = vc[blocks].reshape(-1, nkv, hd)[:end].transpose(0, 1)[None]
            rows = self.qrows[i, :n]
            qs = q[rows].transpose(0, 1)[None]                                       # [1, nh, T, hd]
            if fp64:
                q_pos = torch.arange(start, end, device=q.device)[:, None]
                k_pos = torch.arange(end, device=q.device)[None]
                mask = k_pos <= q_pos
                if window is not None:
                    mask &= k_pos > q_pos - window
                out = attention_fp64(qs, k, v, mask[None, None]).to(q.dtype)
            else:
                out = reference_attention(qs, k, v, start, window)
            packed[rows] = out[0].transpose(0, 1)


def attention_fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v in float64 (GQA by grouping query heads): rounding to
    float32 afterwards makes the result independent of padding and chunking in practice."""
    B, nh, T, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    qg = q.double().view(B, nkv, g, T, hd)
    s = qg @ k.double()[:, :, None].transpose(-1, -2) / hd ** 0.5                 # [B, nkv, g, T, S]
    s = s.masked_fill(~mask[:, :, None], float("-inf"))
    return (torch.softmax(s, dim=-1) @ v.double()[:, :, None]).view(B, nh, T, hd)


class SequenceBatchCache:
    """One step over per-sequence caches (each with the :mod:`workbench.model.kv_cache` interface):
    ``items`` are ``(cache, start, num_tokens)`` in row order.  Each sequence's rows attend
    through its own cache, so a contiguous or tiered cache serves a batched step exactly as it
    serves a single request."""

    def __init__(self, items: list[tuple[object, int, int]]) -> None:
        self.items, off = [], 0
        for cache, start, n in items:
            self.items.append((cache, start, off, n))
            off += n

    def attend(self, attn, q, k, v, start: int = 0, written: bool = False) -> torch.Tensor:
        out = q.new_zeros(q.shape)                                         # [1, nh, rows, hd]
        for cache, s, off, n in self.items:
            sl = slice(off, off + n)
            out[:, :, sl] = cache.attend(attn, q[:, :, sl], k[:, :, sl], v[:, :, sl], s)
        return out
