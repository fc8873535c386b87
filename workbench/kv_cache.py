"""Contiguous KV cache of the reference engine.

One preallocated tensor pair per layer, ``k, v: [B, nkv, max_len, hd]``; a step writes its new
keys/values at ``[start, start+T)`` and attends over ``[0, start+T)``.  Simple and exact, it
wastes memory for short sequences and cannot share prefixes between requests: the paged pool
of the KV-tiers layer replaces it and is checked against it.
"""

from __future__ import annotations

import torch

from .config import ModelConfig


class KVCache:
    def __init__(self, cfg: ModelConfig, batch_size: int, max_len: int, device=None,
                 dtype: torch.dtype = torch.float32) -> None:
        shape = (batch_size, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(cfg.num_hidden_layers)]
        self.max_len = max_len
        self.length = 0  # tokens written so far (set by the model after each forward)

    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Write k/v [B, nkv, T, hd] at positions [start, start+T); return the valid prefix."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens > capacity {self.max_len}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def nbytes(self) -> int:
        """Bytes allocated (not only used) by this cache."""
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
