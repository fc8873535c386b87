"""The KV cache of a model shape at a context length: the formula, the package's exact layout bytes,
and a real allocation measured from its tensors.

::

    res = kv_size(preset_config("llama-2-7b"), tokens=32768, dtype="float16",
                  allocations=[(1, 32768), (32, 2048)])      # (layers, tokens) actually allocated
    res["formula_bytes"], res["layout_bytes"], res["allocations"][0]["bytes_per_layer_token"]

* formula: ``layers x 2 (K and V) x kv_heads x head_dim x tokens x dtype bytes``;
* layout: :class:`workbench.kv.layout.KVLayout` (``bytes_for_tokens``: whole blocks);
* allocations: for each ``(layers, tokens)``, a real :class:`~workbench.kv.paged.PagedKVPool` (every
  layer's K and V ``[blocks, block_size, kv_heads, head_dim]``) and a real contiguous
  :class:`~workbench.model.kv_cache.KVCache` (``[1, kv_heads, tokens, head_dim]`` per layer) of the
  model's shape with that many layers, in ``dtype``, on ``device``; bytes from their storages
  (:func:`workbench.measure.memory.storage_bytes`) and the process's resident set before / after
  (the tensors are zero-filled, so their pages are touched).  ``extrapolated_bytes`` scales the
  measured bytes per (layer, token) linearly to the full model and context -- exact when the
  allocations agree on that figure, which the caller should check (``per_layer_token_equal``).

Allocations are freed before the function returns.  Size them to the machine: one Llama-2-7B layer at
32K tokens in fp16 is 512 MiB per cache.
"""

from __future__ import annotations

import dataclasses
import gc
import time

from workbench.kv.layout import KVLayout, dtype_bytes
from workbench.measure.memory import storage_bytes


def kv_formula_bytes(cfg, tokens: int, element_bytes: int) -> int:
    """``layers x 2 x kv_heads x head_dim x tokens x element_bytes``."""
    return cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim * tokens * element_bytes


def _rss() -> int | None:
    from workbench.bench.request_memory import rss_bytes

    return rss_bytes()


def measure_allocation(cfg, layers: int, tokens: int, dtype, block_size: int = 16, device="cpu") -> dict:
    """Allocate a paged pool and a contiguous cache for ``layers`` layers x ``tokens`` tokens of
    ``cfg``'s shape; their bytes from the storages and the resident-set growth, then free them."""
    import torch

    from workbench.kv.paged import PagedKVConfig, PagedKVPool
    from workbench.model.kv_cache import KVCache

    tdtype = getattr(torch, str(dtype).removeprefix("torch.")) if isinstance(dtype, str) else dtype
    small = dataclasses.replace(cfg, num_hidden_layers=layers)
    blocks = -(-tokens // block_size)
    out = {"layers": layers, "tokens": tokens, "dtype": str(tdtype).removeprefix("torch."), "block_size": block_size}
    gc.collect()
    r0, t0 = _rss(), time.perf_counter()
    pool = PagedKVPool(small, PagedKVConfig(block_size=block_size, num_blocks=blocks, enable_prefix_caching=False),
                       torch.device(device), tdtype, blocks * block_size)
    out["paged_bytes"] = storage_bytes(pool.k_cache + pool.v_cache)
    out["paged_layout_bytes"] = pool.layout.bytes_for_tokens(tokens)
    out["paged_tensor_shape"] = list(pool.k_cache[0].shape)
    r1 = _rss()
    out["paged_rss_growth"] = None if r0 is None or r1 is None else r1 - r0
    del pool
    gc.collect()
    r2 = _rss()
    cache = KVCache(small, 1, tokens, device=device, dtype=tdtype)
    out["contiguous_bytes"] = storage_bytes(cache.k + cache.v)
    out["contiguous_tensor_shape"] = list(cache.k[0].shape)
    r3 = _rss()
    out["contiguous_rss_growth"] = None if r2 is None or r3 is None else r3 - r2
    del cache
    gc.collect()
    out["seconds"] = time.perf_counter() - t0
    out["bytes_per_layer_token"] = out["paged_bytes"] / (layers * blocks * block_size)
    out["contiguous_bytes_per_layer_token"] = out["contiguous_bytes"] / (layers * tokens)
    return out


def kv_size(cfg, tokens: int, dtype="float16", allocations=((1, 4096),), block_size: int = 16,
            device="cpu") -> dict:
    """Formula, layout and measured bytes of ``cfg``'s KV cache at ``tokens`` (see the module docstring)."""
    e = dtype_bytes(dtype)
    formula = kv_formula_bytes(cfg, tokens, e)
    layout = KVLayout.from_model_config(cfg, block_size, dtype)
    allocs = [measure_allocation(cfg, layers, n, dtype, block_size, device) for layers, n in allocations]
    per = [a["bytes_per_layer_token"] for a in allocs] + [a["contiguous_bytes_per_layer_token"] for a in allocs]
    return {"layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads, "head_dim": cfg.head_dim,
            "tokens": tokens, "element_bytes": e, "formula_bytes": formula,
            "layout_bytes": layout.bytes_for_tokens(tokens), "layout_bytes_per_token": layout.bytes_per_token,
            "allocations": allocs, "per_layer_token_equal": len(set(per)) == 1,
            "extrapolated_bytes": per[0] * cfg.num_hidden_layers * tokens if per else None}


__all__ = ["kv_formula_bytes", "kv_size", "measure_allocation"]
