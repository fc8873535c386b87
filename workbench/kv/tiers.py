"""The three-zone KV cache (hot / warm / cold) with attention-mass routing, as a transformation.

::

    cache = TieredKVCache(model.config, TierConfig(window=128, rank=8, warm_tokens=256, budget=64), basis)
    with tiered_attention(model):                     # a flag on the attention modules; model.py untouched
        logits = model(ids, cache=cache)              # every query sees the cache as the policy keeps it
    cache.resident_bytes(), cache.fetched_bytes_by_pos

Without :func:`tiered_attention` the same cache is a plain exact cache (``update`` returns the
full-precision K/V, the *exact path*); zones, routing and byte counts are only applied by
:meth:`TieredKVCache.attend`.  Zone boundaries and bytes: :mod:`workbench.kv.tier_config`.

What each query at position p attends to (per layer, batch row and KV head)::

    hot tokens                 exact K, V
    warm tokens                K^ = mean + U c (rank-r PCA), V (full or int8-dequantised)
    cold chunk j (C tokens)    one pseudo-token: key  K_j = mean of its keys, value V_j = mean of
                               its values, logit  q.K_j/sqrt(d) + log C
    routed (fetched) blocks    exact K, V fetched from the offload tier, replacing the above
    cold_mode="drop"           cold tokens are evicted: not attended, not routable (the control)

Cold-chunk approximation.  Exactly, a chunk contributes ``sum_i e^{s_i} v_i`` to the softmax
numerator and ``sum_i e^{s_i}`` to its denominator (``s_i = q.k_i / sqrt(d)``).  Replacing each
``s_i`` by the logit of the mean key, ``s = q.mean(k) / sqrt(d)`` (the first-order expansion
around the mean: the linear terms cancel, ``sum_i (s_i - s) = 0``) gives ``C e^{s}`` and
``C e^{s} mean(v)``: one pseudo-token whose logit carries ``+ log C``.  It is exact when the keys
of the chunk are equal (so for C = 1); otherwise it underestimates the mass by Jensen
(``mean e^{s_i} >= e^{mean s_i}``; the second-order correction would be ``q^T Sigma q / 2d``), and
the value is the unweighted mean instead of the attention-weighted one.

Routing (Quest-like, but from the compressed keys rather than per-block min/max bounds).  The
non-hot tokens are cut into blocks of ``block`` tokens aligned at ``sink``.  For each query and
KV head, a block's predicted attention mass is ``logsumexp`` over its tokens and over the query
heads of the GQA group of the *approximate* logits (warm: ``q.K^``; cold: ``q.K_j`` per token of
the chunk).  The top ``budget // block`` blocks are attended exactly with keys and values
"fetched from the offload tier" (the full-precision copy this object keeps); the bytes that
would move are counted per query position in :attr:`TieredKVCache.fetched_bytes_by_pos`.

Simulation note: the cache keeps every representation of every token (full K/V = offload tier,
PCA coefficients and their reconstruction, int8 values) so any query can be served; the byte
accounting counts only what the policy keeps resident.  Multi-token calls (prefill) give every
query position its own view of the cache, exactly as token-by-token decoding would, so a
teacher-forced forward over a document in one call equals decoding it step by step (tested).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from workbench.model.config import ModelConfig
from workbench.errors import ConfigError
from workbench.model.decoder import Attention, CausalLM, RotaryEmbedding, reference_attention
from workbench.kv.pca import PCABasis
from workbench.kv.tier_attention import (attend_zones, chunk_means, int8_values, key_coefficients,
                                         reconstruct_keys)
from workbench.kv.tier_config import (TierConfig, ZoneCounts, basis_bytes, full_bytes_per_token, resident_bytes,
                                      zone_counts, zone_masks)


def check_tier_setup(who: str, model_cfg: ModelConfig, cfg: TierConfig, basis: PCABasis | None) -> None:
    """A ConfigError naming the field when ``cfg`` and ``basis`` cannot serve ``model_cfg``."""
    if not isinstance(cfg, TierConfig):
        raise ConfigError(f"{who}: cfg must be a TierConfig, got {type(cfg).__name__}")
    if cfg.has_warm:
        if basis is None:
            raise ConfigError(f"{who}: field 'basis' is required when the config has a warm zone "
                              "(all but warm_tokens=0 with chunk=1); fit one with "
                              "workbench.kv.pca.fit_pca_from_model")
        basis.check_model(model_cfg)
        if cfg.rank > basis.max_rank:
            raise ConfigError(f"TierConfig field 'rank' ({cfg.rank}) exceeds the basis' rank "
                              f"({basis.max_rank}, head_dim {model_cfg.head_dim})")
        if basis.key_space != cfg.key_space:
            raise ConfigError(f"TierConfig field 'key_space' is {cfg.key_space!r} but the basis was fitted "
                              f"on {basis.key_space!r} keys; refit or change key_space")


class TieredKVCache:
    """Model cache interface (``update``, ``length``) plus :meth:`attend` for the tiered policy.

    Per layer, each [B, nkv, max_len, ...]: ``k``/``v`` full precision (the offload tier and the
    hot zone), ``coef`` rank-r key coefficients and ``k_hat`` their reconstruction (warm keys),
    ``vq``/``vscale``/``v_hat`` int8 values (warm values when ``value_format="int8"``).
    """

    def __init__(self, model_cfg: ModelConfig, cfg: TierConfig, basis: PCABasis | None = None,
                 batch_size: int = 1, max_len: int | None = None, device=None,
                 dtype: torch.dtype = torch.float32) -> None:
        check_tier_setup("TieredKVCache", model_cfg, cfg, basis)
        L, nkv, hd = model_cfg.num_hidden_layers, model_cfg.num_key_value_heads, model_cfg.head_dim
        self.model_cfg, self.cfg, self.basis = model_cfg, cfg, basis
        self.max_len = max_len or model_cfg.max_position_embeddings
        self.batch_size, self.dtype = batch_size, dtype
        shape = (batch_size, nkv, self.max_len, hd)
        z = lambda s=shape, dt=dtype: [torch.zeros(s, device=device, dtype=dt) for _ in range(L)]  # noqa: E731
        self.k, self.v = z(), z()
        self.length = 0
        if cfg.has_warm:
            self.mean = basis.mean.to(device, torch.float32)                       # [L, nkv, hd]
            self.U = basis.components[..., :cfg.rank].to(device, torch.float32)   # [L, nkv, hd, r]
            self.coef = z(shape[:3] + (cfg.rank,))
            self.k_hat = z()
            self.rope = RotaryEmbedding(model_cfg) if cfg.key_space == "pre_rope" else None
        if cfg.value_format == "int8":
            self.vq = z(dt=torch.int8)
            self.vscale = z(shape[:3] + (1,), torch.float16)
            self.v_hat = z()
        # Routing statistics: bytes / tokens fetched from the offload tier, per query position,
        # summed over layers, batch rows and KV heads.
        self.fetched_bytes_by_pos = torch.zeros(self.max_len, dtype=torch.float64)
        self.fetched_tokens_by_pos = torch.zeros(self.max_len, dtype=torch.float64)
        self.last_selection: dict[int, torch.Tensor] = {}   # layer -> [B, nkv, T, n_blocks] bool

    # ---- the model's cache interface (exact path) -------------------------------------
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor, start: int):
        """Write k/v [B, nkv, T, hd] at [start, start+T) in every representation; return the
        full-precision prefix (so the reference attention over this cache is exact)."""
        end = start + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache overflow: {end} tokens > capacity {self.max_len}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        if self.cfg.has_warm:
            rope = self.rope(start, end, k.device, torch.float32) if self.rope is not None else None
            c = key_coefficients(k, self.mean[layer], self.U[layer], rope, dtype=self.dtype)
            self.coef[layer][:, :, start:end] = c
            self.k_hat[layer][:, :, start:end] = reconstruct_keys(c, self.mean[layer], self.U[layer], rope,
                                                                  self.dtype)
        if self.cfg.value_format == "int8":
            q, scale, v_hat = int8_values(v)
            self.vq[layer][:, :, start:end] = q
            self.vscale[layer][:, :, start:end] = scale
            self.v_hat[layer][:, :, start:end] = v_hat
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    # ---- the attention interface (workbench.model.kv_cache) -----------------------------------
    def attend(self, attn, q, k, v, start: int, written: bool = False) -> torch.Tensor:
        """Write k/v in every representation; attend with the tiered policy when the module is
        switched to it (:func:`apply_tiered_attention`), else exactly over the full K/V."""
        K, V = self.update(attn.layer_idx, k, v, start)
        if getattr(attn, "_wb_tiered", False):
            return self.attend_tiered(attn.layer_idx, q, start)
        return reference_attention(q, K, V, start, attn.window)

    # ---- tiered attention ---------------------------------------------------------------
    def attend_tiered(self, layer: int, q: torch.Tensor, start: int) -> torch.Tensor:
        """Attention of queries q [B, nh, T, hd] at positions start..start+T-1 over the tiered
        cache (already updated with those tokens).  Returns [B, nh, T, hd]."""
        cfg = self.cfg
        S = start + q.shape[2]
        m = zone_masks(start, q.shape[2], cfg, device=q.device)
        K, V = self.k[layer][:, :, :S], self.v[layer][:, :, :S]
        k_hat = self.k_hat[layer][:, :, :S] if cfg.has_warm else None
        v_warm = self.v_hat[layer][:, :, :S] if cfg.value_format == "int8" else V
        Kc = Vc = None
        if cfg.cold_mode == "mean" and m.n_chunks:
            lo, hi = cfg.sink, cfg.sink + m.n_chunks * cfg.chunk
            Kc, Vc = chunk_means(K[:, :, lo:hi], cfg.chunk), chunk_means(V[:, :, lo:hi], cfg.chunk)

        def on_route(sel, per_q):
            self.last_selection[layer] = sel
            self.fetched_bytes_by_pos[start:S] += per_q.cpu()

        def count(fetched):
            self.fetched_tokens_by_pos[start:S] += fetched.sum((0, 1, 2, 4)).double().cpu()

        return attend_zones(cfg, q, start, m, K, V, k_hat, v_warm, Kc, Vc, fetch=count, on_route=on_route)

    # ---- accounting -----------------------------------------------------------------------
    def zone_counts(self, length: int | None = None) -> ZoneCounts:
        return zone_counts(self.length if length is None else length, self.cfg)

    def resident_bytes(self, length: int | None = None, include_basis: bool = True) -> int:
        """Fast-memory bytes the policy keeps for this batch at ``length`` tokens (default: now)."""
        c = self.model_cfg
        return resident_bytes(self.length if length is None else length, self.cfg, c.num_hidden_layers,
                              c.num_key_value_heads, c.head_dim, self.batch_size, include_basis)

    def full_resident_bytes(self, length: int | None = None) -> int:
        """The same batch in a plain cache at the same element size."""
        c = self.model_cfg
        n = self.length if length is None else length
        return self.batch_size * n * full_bytes_per_token(c.num_hidden_layers, c.num_key_value_heads,
                                                          c.head_dim, self.cfg.element_bytes)

    def basis_bytes(self) -> int:
        c = self.model_cfg
        return basis_bytes(self.cfg, c.num_hidden_layers, c.num_key_value_heads, c.head_dim)


def apply_tiered_attention(model: CausalLM) -> CausalLM:
    """Make every layer's attention serve a :class:`TieredKVCache` with the tiered policy (in
    place; returns model).  A flag on each attention module, read by the cache: other caches
    keep the exact path, and per-op backends (``workbench.transforms.backends``) compose with it."""
    if model.config.sliding_window is not None:
        raise ConfigError(f"tiered attention does not support sliding-window models "
                          f"(config field 'sliding_window' = {model.config.sliding_window})")
    for i, layer in enumerate(model.model.layers):
        if not isinstance(layer.self_attn, Attention):
            raise ConfigError(f"layer {i}: self_attn is a {type(layer.self_attn).__name__}, expected an Attention")
        layer.self_attn._wb_tiered = True
    return model


def remove_tiered_attention(model: CausalLM) -> CausalLM:
    for layer in model.model.layers:
        layer.self_attn.__dict__.pop("_wb_tiered", None)
    return model


def is_tiered(model: CausalLM) -> bool:
    """Is the tiered policy switched on for ``model``'s attention?"""
    return all(getattr(layer.self_attn, "_wb_tiered", False) for layer in model.model.layers)


@contextmanager
def tiered_attention(model: CausalLM):
    """``with tiered_attention(model): model(ids, cache=tiered_cache)`` - undone on exit."""
    apply_tiered_attention(model)
    try:
        yield model
    finally:
        remove_tiered_attention(model)
