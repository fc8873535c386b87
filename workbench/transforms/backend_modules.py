"""The modules :func:`~workbench.transforms.backends.apply_backends` swaps in: the reference
modules of :mod:`workbench.model.decoder` with their ops called through their declared ``ops``
field (the :class:`~workbench.model.ops.Ops` of the chosen backends, never None in these classes).
Same parameters and names as the classes they replace; only ``forward`` differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workbench.model.decoder import MLP, Attention, DecoderLayer, RMSNorm, reference_attention
from workbench.model.ops import Ops


class BackendRMSNorm(RMSNorm):
    ops: Ops

    def forward(self, x):
        return self.ops.rmsnorm(x, self.weight, self.eps)

    def forward_residual(self, x, residual):
        """(norm(residual + x), residual + x) - the decoder layer's add and norm, fused."""
        return self.ops.add_rmsnorm(x, residual, self.weight, self.eps)


class BackendDecoderLayer(DecoderLayer):
    def forward(self, x, cos, sin, start, cache):
        a = self.self_attn(self.input_layernorm(x), cos, sin, start, cache)
        h, x = self.post_attention_layernorm.forward_residual(a, x)      # x = x + a; h = norm(x)
        return x + self.mlp(h)


class BackendMLP(MLP):
    ops: Ops

    def forward(self, x):
        return self.down_proj(self.ops.swiglu(self.gate_proj(x), self.up_proj(x)))


def _token_rows(B: int, T: int, device) -> torch.Tensor:
    """Row of the layer's cos/sin [T, hd] for each of the B*T tokens (all rows share ``start``)."""
    return torch.arange(T, device=device).repeat(B)


class BackendAttention(Attention):
    """Projections, then ``ops.rope`` (or, with ``rope=triton`` and a cache that exposes its
    slots, ``ops.rope_kv_write``: rotation and the K/V write in one launch); the cache then
    attends with the module's attention entry points (:mod:`workbench.model.kv_cache`)."""

    ops: Ops

    def forward(self, x, cos, sin, start, cache):
        ops = self.ops
        B, T, _ = x.shape
        nh, nkv, hd = self.nh, self.nkv, self.hd
        q = self.q_proj(x).view(B * T, nh, hd)                 # [tokens, heads, hd]
        k = self.k_proj(x).view(B * T, nkv, hd)
        v = self.v_proj(x).view(B * T, nkv, hd)
        if getattr(cache, "static_decode", False):
            return self._static_decode(q, k, v, cos, sin, cache, B)
        rows = _token_rows(B, T, x.device)
        written = False
        if cache is not None and ops.backends["rope"] == "triton" and hasattr(cache, "write_slots"):
            kc, vc = cache.kv_storage(self.layer_idx)
            q, k = ops.rope_kv_write(q, k, v, cos, sin, rows, kc, vc, cache.write_slots(B, start, T))
            written = True                                      # rope + K/V write in one kernel
        else:
            q, k = ops.rope(q, k, cos, sin, rows)
        q = q.view(B, T, nh, hd).transpose(1, 2)                # [B, nh, T, hd]
        K, V = (t.view(B, T, -1, hd).transpose(1, 2) for t in (k, v))
        if cache is None:
            if start == 0 and self.window is None and ops.backends["attention_prefill"] != "eager":
                out = ops.attention_prefill(q, K, V, causal=T > 1)
            else:
                out = reference_attention(q, K, V, start, self.window)
        else:
            out = cache.attend(self, q, K, V, start, written=written)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, nh * hd))

    def _static_decode(self, q, k, v, cos, sin, cache, B):
        """CUDA-graph-safe decode (see workbench.transforms.cuda_graphs): positions, slots and the mask are
        tensors; attention runs over the whole static cache (or the rows' blocks of the paged pool,
        workbench.transforms.paged_graphs); no shape depends on the step."""
        if hasattr(cache, "attend_decode"):                      # over the paged pool (paged_graphs)
            return self.o_proj(cache.attend_decode(self, q, k, v, cos, sin).reshape(B, 1, self.nh * self.hd))
        ops, layer, hd = self.ops, self.layer_idx, self.hd
        kc = cache.k[layer].permute(0, 2, 1, 3)                   # [rows, max_len, nkv, hd]
        vc = cache.v[layer].permute(0, 2, 1, 3)
        if ops.backends["rope"] == "triton":
            q, k = ops.rope_kv_write(q, k, v, cos, sin, cache.positions, kc, vc, cache.slots)
        else:   # slots are always valid here (padding rows write to a scratch row): a plain index_put
            q, k = ops.rope(q, k, cos, sin, cache.positions)
            ml = cache.max_len
            kc[cache.slots // ml, cache.slots % ml] = k
            vc[cache.slots // ml, cache.slots % ml] = v
        if ops.backends["attention_decode"] != "eager":
            out = ops.attention_decode(q, kc, vc, cache.block_tables, cache.seq_lens,
                                       sliding_window=self.window)                            # [B, nh, hd]
        else:
            out = F.scaled_dot_product_attention(q[:, :, None], cache.k[layer][:B], cache.v[layer][:B],
                                                 attn_mask=cache.mask, enable_gqa=self.nh != self.nkv)[:, :, 0]
        return self.o_proj(out.reshape(B, 1, self.nh * hd))
