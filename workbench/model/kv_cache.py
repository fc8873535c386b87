"""The KV-cache interface every attention call goes through, and the contiguous cache.

One interface, several caches.  ``Attention.forward`` projects and rotates q/k/v, then hands
them to the cache it was given::

    out = cache.attend(attn, q, k, v, start)      # q [B, nh, T, hd], k/v [B, nkv, T, hd] -> [B, nh, T, hd]

The cache writes the new keys/values where it keeps them and attends over what it holds,
choosing the attention kernel from the backend entry points in the module's declared ``ops`` field
(a :class:`~workbench.model.ops.Ops` set by :func:`workbench.transforms.backends.apply_backends`;
None: the reference).
Implementations::

    KVCache               contiguous [B, nkv, max_len, hd] per layer (this module; the reference)
    PagedSequenceCache    one sequence's view of the paged pool (workbench.kv.paged)
    PagedBatchCache       a packed step of many sequences over the paged pool (workbench.kv.batch)
    SequenceBatchCache    a packed step over per-sequence caches (workbench.kv.batch)
    TieredKVCache         hot / warm / cold zones with routing (workbench.kv.tiers)

Optional, for the fused RoPE + K/V write (``rope=triton``): ``write_slots(B, start, T)`` gives
the slot of each new token in the storage ``kv_storage(layer)`` returns (paged layout
``[num_blocks, block_size, nkv, hd]``); the module then writes k/v itself and calls
``attend(..., written=True)``.  A cache without these (tiered) gets the unfused path.

A physical tiered cache (hot K/V resident, warm and cold summaries resident, full blocks
fetched on demand) is one more implementation: ``attend`` is where it fetches what routing
selects before attending, so nothing above the cache changes.
"""

from __future__ import annotations

import torch

from workbench.model.config import ModelConfig
from workbench.model.ops import Ops
from workbench.model.decoder import reference_attention


def attention_ops(attn) -> Ops | None:
    """The backend entry points an attention module holds (its ``ops`` field), or None when it is
    the reference module or every attention-side op is ``eager``.  An object without the field
    (a stand-in that carries only ``layer_idx``) counts as the reference."""
    ops: Ops | None = getattr(attn, "ops", None)
    if ops is None or not any(ops.uses_kernel(op) for op in ("rope", "attention_decode", "attention_prefill")):
        return None
    return ops


def uses_kernel(ops: Ops | None, op: str) -> bool:
    """True when ``ops`` (None: the reference) runs ``op`` on a backend other than ``eager``."""
    return ops is not None and ops.uses_kernel(op)


def attend_sequences(cache, attn, q, start: int, tables, context) -> torch.Tensor:
    """Attention for a cache that holds whole sequences (each query row's sequence is row b),
    with this step's K/V already written: the decode kernel on ``cache.kv_storage`` through the
    block tables ``tables()`` when the module's backend has one, else the context ``context()``
    (K, V [B, nkv, S, hd]) to the prefill kernel (from position 0, no window) or the reference."""
    T = q.shape[2]
    ops = attention_ops(attn)
    if T == 1 and uses_kernel(ops, "attention_decode"):
        kc, vc = cache.kv_storage(attn.layer_idx)
        lens = torch.full((q.shape[0],), start + 1, device=q.device, dtype=torch.int32)
        return ops.attention_decode(q[:, :, 0], kc, vc, tables(), lens, sliding_window=attn.window)[:, :, None]
    K, V = context()
    if start == 0 and attn.window is None and uses_kernel(ops, "attention_prefill"):
        return ops.attention_prefill(q, K, V, causal=T > 1)
    return reference_attention(q, K, V, start, attn.window)


class KVCache:
    """Contiguous KV cache of the reference engine.

    One preallocated tensor pair per layer, ``k, v: [B, nkv, max_len, hd]``; a step writes its
    new keys/values at ``[start, start+T)`` and attends over ``[0, start+T)``.  Simple and exact,
    it wastes memory for short sequences and cannot share prefixes between requests: the paged
    pool of the KV-tiers layer replaces it and is checked against it.
    """

    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, device=None,
                 dtype: torch.dtype = torch.float32) -> None:
        shape = (batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.max_len = max_len
        self.length = 0  # tokens written so far (set by the model after each forward)
        self._slots_key = self._slots = None

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Write k/v [B, nkv, T, hd] at positions [start, start+T); return the valid prefix."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens > capacity {self.max_len}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    # ---- the attention interface ---------------------------------------------------------
    def attend(self, attn, q, k, v, start: int, written: bool = False) -> torch.Tensor:
        layer, end = attn.layer_idx, start + q.shape[2]
        if not written:
            self.update(layer, k, v, start)
        B = q.shape[0]
        return attend_sequences(self, attn, q, start,   # one block of max_len per sequence
                                lambda: torch.arange(B, device=q.device, dtype=torch.int32)[:, None],
                                lambda: (self.k[layer][:, :, :end], self.v[layer][:, :, :end]))

    def kv_storage(self, layer: int):
        """A layer's k/v as paged storage [B, max_len, nkv, hd] (views): row b is block b."""
        return self.k[layer].permute(0, 2, 1, 3), self.v[layer].permute(0, 2, 1, 3)

    def write_slots(self, B: int, start: int, T: int) -> torch.Tensor:
        """Slot of each new token (row-major over [B, T]) in :meth:`kv_storage`, once per forward."""
        key = (B, start, T)
        if self._slots_key != key:
            kb, end = self.k[0].shape[0], start + T
            if B != kb:
                raise ValueError(f"batch {B} does not match the KV cache's batch {kb}")
            if end > self.max_len:
                raise ValueError(f"KV cache overflow: {end} tokens > capacity {self.max_len}")
            dev = self.k[0].device
            base = torch.arange(B, device=dev)[:, None] * self.max_len
            self._slots = (base + torch.arange(start, end, device=dev)[None, :]).reshape(-1)
            self._slots_key = key
        return self._slots

    def row(self, row: int) -> KVCache:
        """A cache over row ``row`` of this one, without allocating: its tensors are views, so
        writes land here (the CUDA-graph decoder prefills one sequence into its batch this way)."""
        view = KVCache.__new__(KVCache)
        view.k = [t[row:row + 1] for t in self.k]
        view.v = [t[row:row + 1] for t in self.v]
        view.max_len, view.length = self.max_len, 0
        view._slots_key = view._slots = None
        return view

    def nbytes(self) -> int:
        """Bytes allocated (not only used) by this cache."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
