"""The model side of the batched engine: one forward over every scheduled token of a step.

All tokens of a step (prefill chunks and decode tokens of many sequences) are packed into one
``[N, hidden]`` matrix, so every position-wise module (norms, q/k/v/o projections, the MLP, the
LM head) runs once per step for the whole batch.  Attention is the only part that needs to
know which token belongs to which sequence: each token's K/V is written to its slot of the
paged pool, then every sequence's queries attend over its own context, gathered through its
block table into a padded ``[B, nkv, S_max, hd]`` batch with a mask.

**Batch invariance.**  Continuous batching must not change what a request generates: the
same greedy tokens alone, in a batch, with chunked prefill or after preemption.  Two things
break that on a CPU in float32 (measured in the scheduler notebook):

* a matrix multiply with few rows (M < 16) takes a different kernel than with many, so the
  same row gets a different rounding — fixed here by padding the packed tokens to at least
  ``MIN_ROWS`` rows, which keeps every row on the same kernel;
* attention's reductions run over a length that depends on padding and chunking — fixed by
  computing attention in float64 and rounding to the model's dtype: the reduction order then
  changes only bits far below float32's precision.

Both cost time, so ``batch_invariant=False`` switches them off (plain SDPA, no padding) for
speed studies; on a GPU in bf16 it is off by default.  The module calls go through the
model's own modules (``layer.mlp(...)``, ``attn.q_proj(...)``), so per-op backends and
quantized layers applied to the model are used here too.

**Per-op backends of the attention side** (``workbench.backends``).  RoPE, the K/V write and
attention are done here over the packed batch, not by the attention module, so the runner
reads the backend entry points the model's attention modules hold (``attn._wb_ops``, what
:func:`~workbench.backends.apply_backends` set) at every step, layer by layer: a backend applied
or removed between steps takes effect at the next step.  With the reference modules (or an op
on ``eager``) the step is exactly the path described above.  Otherwise:

* ``rope``: ``triton`` -> ``rope_kv_write`` (rotation and the paged K/V write in one launch;
  padding rows get slot -1, skipped); ``compile`` -> ``rope`` then the same K/V write;
* ``attention_decode`` (any non-eager backend) -> the decode group (one query per sequence)
  calls ``ops.attention_decode`` on the pool's layer tensors ``[num_blocks, block_size, nkv,
  hd]`` with int32 block tables and lengths, and the model's sliding window;
* ``attention_prefill`` (any non-eager backend) -> the prefill-chunk group calls
  ``ops.attention_prefill_paged``: ragged queries packed sequence after sequence, keys read
  from the pool through the block tables (a chunk attends to its cached prefix), causal mask
  aligned bottom-right, the model's sliding window.  (The op's other entry point,
  ``attention_prefill``, takes queries = keys from position 0, which a chunk is not.)
  ``compile`` has both entry points too: ``torch.compile`` of the eager references.

The kernels compute attention in float32 (not the float64 of batch-invariant mode), so with
them on, greedy tokens match the eager engine as far as float32 rounding allows, and on a GPU
the decode kernel's split count depends on the batch: bitwise batch invariance is a property
of the eager path only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kv.paged import PagedKVPool
from ..model import CausalLM, rotate_half
from .scheduler import ScheduledSeq, SwapIn, SwapOut

MIN_ROWS = 16


class ModelRunner:
    def __init__(self, model: CausalLM, pool: PagedKVPool, batch_invariant: bool | None = None) -> None:
        self.model, self.pool = model, pool
        cfg = model.config
        self.nh, self.nkv, self.hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.device = model.device
        dtype = model.lm_head.weight.dtype
        self.batch_invariant = (self.device.type == "cpu" and dtype == torch.float32) \
            if batch_invariant is None else batch_invariant
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
        layers = []
        for layer in range(len(self.pool.k_cache)):
            slots, k, v = self._gather(s.block_table, 0, s.num_tokens, layer)
            layers.append(torch.stack((k[slots], v[slots])))
        pin = self.device.type == "cuda"
        host = torch.stack(layers).to("cpu")
        self.swap_space[s.seq.request_id] = host.pin_memory() if pin else host

    def swap_in(self, s: SwapIn) -> None:
        saved = self.swap_space.pop(s.seq.request_id).to(self.device)
        table = self.pool.manager.block_table(s.seq.request_id)
        for layer in range(len(self.pool.k_cache)):
            slots, k, v = self._gather(table, s.num_cached, s.num_tokens, layer)
            k[slots] = saved[layer, 0, s.num_cached:s.num_tokens]
            v[slots] = saved[layer, 1, s.num_cached:s.num_tokens]

    def drop_swap(self, request_id: str) -> None:
        self.swap_space.pop(request_id, None)

    # ---- the forward ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        """Run the step; returns logits [k, vocab] for the sequences that sample (in order)."""
        model, m, dev = self.model, self.pool.manager, self.device
        tokens, positions, slots, rows_of = [], [], [], []
        for s in scheduled:
            end = s.start + s.num_tokens
            rows_of.append(range(len(tokens), len(tokens) + s.num_tokens))
            tokens += s.seq.tokens[s.start:end]
            positions += range(s.start, end)
            slots += m.slot_mapping(s.seq.request_id, s.start, end)
        N = len(tokens)
        pad = max(0, MIN_ROWS - N) if self.batch_invariant else 0
        tok = torch.tensor(tokens + [0] * pad, device=dev)
        pos = torch.tensor(positions + [0] * pad, device=dev)
        slot_t = torch.tensor(slots, device=dev)
        slot_pad = None                                                      # slots + -1 per padding row
        x = model.model.embed_tokens(tok)                                    # [N+pad, H]
        cos_t, sin_t = model.model.rotary_emb(0, max(positions) + 1, dev, x.dtype)   # tables [P, hd]
        cos, sin = cos_t[pos][:, None], sin_t[pos][:, None]                  # [N+pad, 1, hd]
        batch = _AttentionBatch(self, scheduled, rows_of, N + pad)
        for li, layer in enumerate(model.model.layers):
            attn = layer.self_attn
            ops = attention_ops(attn)                                        # None: all eager
            rope = ops.backends["rope"] if ops is not None else "eager"
            h = layer.input_layernorm(x)
            q = attn.q_proj(h).view(-1, self.nh, self.hd)
            k = attn.k_proj(h).view(-1, self.nkv, self.hd)
            v = attn.v_proj(h).view(-1, self.nkv, self.hd)
            if rope == "triton":                                             # rotation + K/V write, fused
                if slot_pad is None:
                    slot_pad = torch.tensor(slots + [-1] * pad, dtype=torch.long, device=dev)
                q, k = ops.rope_kv_write(q, k, v, cos_t, sin_t, pos, self.pool.k_cache[li],
                                         self.pool.v_cache[li], slot_pad)
            else:
                if rope == "eager":
                    q = q * cos + rotate_half(q) * sin
                    k = k * cos + rotate_half(k) * sin
                else:
                    q, k = ops.rope(q, k, cos_t, sin_t, pos)
                self.pool.k_cache[li].view(-1, self.nkv, self.hd)[slot_t] = k[:N]
                self.pool.v_cache[li].view(-1, self.nkv, self.hd)[slot_t] = v[:N]
            o = batch.attend(li, q, ops)                                     # [N+pad, nh, hd]
            x = x + attn.o_proj(o.reshape(-1, self.nh * self.hd))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        last = [r[-1] for s, r in zip(scheduled, rows_of) if s.samples]
        if not last:                                                         # only prefill chunks this step
            return x.new_zeros(0, model.config.vocab_size)
        sel = x[torch.tensor(last, dtype=torch.long, device=dev)]
        if self.batch_invariant and len(last) < MIN_ROWS:                    # the LM head is a matmul too
            sel = torch.cat([sel, sel.new_zeros(MIN_ROWS - len(last), sel.shape[1])])
        return model.lm_head(model.model.norm(sel))[:len(last)]


class _AttentionBatch:
    """Per-step attention layout.  Decode tokens (one query per sequence) and prefill chunks
    are attended in separate groups, each padded to its own ``[B, T_max]`` queries and
    ``[B, S_max]`` keys: a 64-token chunk in the step does not pad every decode row to 64
    queries."""

    def __init__(self, runner: ModelRunner, scheduled: list[ScheduledSeq], rows_of, total_rows: int) -> None:
        items = list(zip(scheduled, rows_of))
        decode = [it for it in items if it[0].num_tokens == 1]
        prefill = [it for it in items if it[0].num_tokens > 1]
        self.groups = [_AttentionGroup(runner, g, one) for g, one in ((decode, True), (prefill, False)) if g]
        self.r, self.total_rows = runner, total_rows

    def attend(self, layer: int, q: torch.Tensor, ops=None) -> torch.Tensor:
        packed = q.new_zeros(self.total_rows, self.r.nh, self.r.hd)
        for g in self.groups:
            g.attend(layer, q, packed, ops)
        return packed


class _AttentionGroup:
    """Sequences of one group padded to [B, T_max] queries and [B, S_max] keys, with a mask."""

    def __init__(self, runner: ModelRunner, items: list, decode: bool = False) -> None:
        self.r, self.decode = runner, decode            # decode: one query per sequence
        self._kernel_args = None
        dev, m, Bsz = runner.device, runner.pool.manager, runner.pool.block_size
        scheduled = [s for s, _ in items]
        self.B = len(scheduled)
        self.T = max(s.num_tokens for s in scheduled)
        self.S = max(s.start + s.num_tokens for s in scheduled)
        nblk = -(-self.S // Bsz)
        tables = [m.block_table(s.seq.request_id)[:nblk] for s in scheduled]
        self.tables = torch.tensor([t + [t[-1]] * (nblk - len(t)) for t in tables], device=dev)   # [B, nblk]
        # query rows of the packed matrix, padded per sequence (-1: none)
        qrows = torch.full((self.B, self.T), -1, dtype=torch.long)
        for b, (_, rows) in enumerate(items):
            qrows[b, :len(rows)] = torch.tensor(list(rows))
        self.qrows = qrows.to(dev)
        starts = torch.tensor([s.start for s in scheduled], device=dev)
        q_pos = starts[:, None] + torch.arange(self.T, device=dev)[None]                 # [B, T]
        k_pos = torch.arange(self.S, device=dev)                                          # [S]
        ends = starts + torch.tensor([s.num_tokens for s in scheduled], device=dev)
        valid_q = self.qrows >= 0
        mask = (k_pos[None, None] <= q_pos[..., None]) & (k_pos[None, None] < ends[:, None, None])
        if runner.window is not None:
            mask &= k_pos[None, None] > q_pos[..., None] - runner.window
        mask &= valid_q[..., None]
        mask[..., 0] |= ~valid_q          # padded query rows see one key: finite, then discarded
        self.mask = mask[:, None]                                                         # [B, 1, T, S]
        self.ends, self.q_lens = ends, [s.num_tokens for s in scheduled]

    def kernel_args(self):
        """(query rows [n] long, block_tables [B, nblk] int32, seq_lens [B] int32, cu_seqlens_q
        [B+1] int32) for the attention kernels, made on first use and shared by every layer."""
        if self._kernel_args is None:
            dev = self.r.device
            rows = self.qrows[self.qrows >= 0]            # sequence by sequence, in order
            cu = torch.tensor([0] + self.q_lens, device=dev).cumsum(0).to(torch.int32)
            self._kernel_args = (rows, self.tables.to(torch.int32), self.ends.to(torch.int32), cu)
        return self._kernel_args

    def kernel(self, ops):
        """The backend entry point that attends this group, or None for the path below."""
        op = "attention_decode" if self.decode else "attention_prefill"
        if ops is None or ops.backends[op] == "eager":
            return None
        return ops.attention_decode if self.decode else ops.attention_prefill_paged

    def attend(self, layer: int, q: torch.Tensor, packed: torch.Tensor, ops=None) -> None:
        r = self.r
        fn = self.kernel(ops)
        if fn is not None:
            rows, tables, seq_lens, cu = self.kernel_args()
            kc, vc = r.pool.k_cache[layer], r.pool.v_cache[layer]      # [num_blocks, block_size, nkv, hd]
            if self.decode:
                out = fn(q[rows], kc, vc, tables, seq_lens, sliding_window=r.window)        # [B, nh, hd]
            else:
                out = fn(q[rows], kc, vc, tables, cu, seq_lens, self.T, sliding_window=r.window)  # [n, nh, hd]
            packed[rows] = out.to(q.dtype)
            return
        nh, nkv, hd = r.nh, r.nkv, r.hd
        kc = r.pool.k_cache[layer][self.tables].reshape(self.B, -1, nkv, hd)[:, :self.S]   # [B, S, nkv, hd]
        vc = r.pool.v_cache[layer][self.tables].reshape(self.B, -1, nkv, hd)[:, :self.S]
        qb = q[self.qrows.clamp_min(0)].transpose(1, 2)                                     # [B, nh, T, hd]
        k, v = kc.transpose(1, 2), vc.transpose(1, 2)                                       # [B, nkv, S, hd]
        if r.batch_invariant:
            out = _attention_fp64(qb, k, v, self.mask).to(q.dtype)
        else:
            out = F.scaled_dot_product_attention(qb, k, v, attn_mask=self.mask, enable_gqa=nh != nkv)
        rows = out.transpose(1, 2)                                                          # [B, T, nh, hd]
        valid = self.qrows >= 0
        packed[self.qrows[valid]] = rows[valid]


def attention_ops(attn):
    """The backend entry points an attention module holds (``workbench.backends``), or None
    when it is the reference module or every attention-side op is ``eager``."""
    ops = getattr(attn, "_wb_ops", None)
    if ops is None or all(ops.backends.get(op, "eager") == "eager"
                          for op in ("rope", "attention_decode", "attention_prefill")):
        return None
    return ops


def _attention_fp64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v in float64 (GQA by grouping query heads): rounding to
    float32 afterwards makes the result independent of padding and chunking in practice."""
    B, nh, T, hd = q.shape
    nkv = k.shape[1]
    g = nh // nkv
    qg = q.double().view(B, nkv, g, T, hd)
    s = qg @ k.double()[:, :, None].transpose(-1, -2) / hd ** 0.5                 # [B, nkv, g, T, S]
    s = s.masked_fill(~mask[:, :, None], float("-inf"))
    return (torch.softmax(s, dim=-1) @ v.double()[:, :, None]).view(B, nh, T, hd)
