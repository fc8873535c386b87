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

import math
from contextlib import contextmanager

import torch

from workbench.model.config import ModelConfig
from workbench.errors import ConfigError
from workbench.model.decoder import Attention, CausalLM, RotaryEmbedding, apply_rope
from workbench.kv.pca import PCABasis, unrotate
from workbench.kv.tier_config import (TierConfig, ZoneCounts, basis_bytes, fetch_bytes_per_token, full_bytes_per_token,
                          resident_bytes, zone_counts, zone_masks)

NEG_INF = float("-inf")


class TieredKVCache:
    """Model cache interface (``update``, ``length``) plus :meth:`attend` for the tiered policy.

    Per layer, each [B, nkv, max_len, ...]: ``k``/``v`` full precision (the offload tier and the
    hot zone), ``coef`` rank-r key coefficients and ``k_hat`` their reconstruction (warm keys),
    ``vq``/``vscale``/``v_hat`` int8 values (warm values when ``value_format="int8"``).
    """

    def __init__(self, model_cfg: ModelConfig, cfg: TierConfig, basis: PCABasis | None = None,
                 batch_size: int = 1, max_len: int | None = None, device=None,
                 dtype: torch.dtype = torch.float32) -> None:
        if not isinstance(cfg, TierConfig):
            raise ConfigError(f"TieredKVCache: cfg must be a TierConfig, got {type(cfg).__name__}")
        L, nkv, hd = model_cfg.num_hidden_layers, model_cfg.num_key_value_heads, model_cfg.head_dim
        if cfg.has_warm:
            if basis is None:
                raise ConfigError("TieredKVCache: field 'basis' is required when the config has a warm zone "
                                  "(all but warm_tokens=0 with chunk=1); fit one with "
                                  "workbench.kv.pca.fit_pca_from_model")
            basis.check_model(model_cfg)
            if cfg.rank > basis.max_rank:
                raise ConfigError(f"TierConfig field 'rank' ({cfg.rank}) exceeds the basis' rank "
                                  f"({basis.max_rank}, head_dim {hd})")
            if basis.key_space != cfg.key_space:
                raise ConfigError(f"TierConfig field 'key_space' is {cfg.key_space!r} but the basis was fitted "
                                  f"on {basis.key_space!r} keys; refit or change key_space")
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
            self.coef = z(shape[:3] + (cfg.rank,), torch.float32)
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
            kk = k.float()
            if self.rope is not None:
                cos, sin = self.rope(start, end, k.device, torch.float32)
                kk = unrotate(kk, cos, sin)
            mu, U = self.mean[layer][None, :, None], self.U[layer][None]           # [1,nkv,1,hd], [1,nkv,hd,r]
            c = (kk - mu) @ U                                                      # [B, nkv, T, r]
            rec = mu + c @ U.transpose(-1, -2)
            if self.rope is not None:
                rec = apply_rope(rec, cos, sin)
            self.coef[layer][:, :, start:end] = c
            self.k_hat[layer][:, :, start:end] = rec.to(self.dtype)
        if self.cfg.value_format == "int8":
            scale = (v.float().abs().amax(-1, keepdim=True) / 127).to(torch.float16)
            s = scale.float().clamp_min(torch.finfo(torch.float16).tiny)
            q = torch.round(v.float() / s).clamp(-127, 127).to(torch.int8)
            self.vq[layer][:, :, start:end] = q
            self.vscale[layer][:, :, start:end] = scale
            self.v_hat[layer][:, :, start:end] = (q.float() * s).to(self.dtype)
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    # ---- the attention interface (workbench.model.kv_cache) -----------------------------------
    def attend(self, attn, q, k, v, start: int, written: bool = False) -> torch.Tensor:
        """Write k/v in every representation; attend with the tiered policy when the module is
        switched to it (:func:`apply_tiered_attention`), else exactly over the full K/V."""
        K, V = self.update(attn.layer_idx, k, v, start)
        if getattr(attn, "_wb_tiered", False):
            return self.attend_tiered(attn.layer_idx, q, start)
        from workbench.model.decoder import reference_attention

        return reference_attention(q, K, V, start, attn.window)

    # ---- tiered attention ---------------------------------------------------------------
    def attend_tiered(self, layer: int, q: torch.Tensor, start: int) -> torch.Tensor:
        """Attention of queries q [B, nh, T, hd] at positions start..start+T-1 over the tiered
        cache (already updated with those tokens).  Returns [B, nh, T, hd]."""
        cfg = self.cfg
        B, nh, T, hd = q.shape
        nkv = self.model_cfg.num_key_value_heads
        g, S = nh // nkv, start + T
        m = zone_masks(start, T, cfg, device=q.device)
        qg = q.float().view(B, nkv, g, T, hd) / math.sqrt(hd)
        K, V = self.k[layer][:, :, :S].float(), self.v[layer][:, :, :S].float()
        s_ex = qg @ K[:, :, None].transpose(-1, -2)                              # [B, nkv, g, T, S]
        any_warm, nC = bool(m.warm.any()), m.n_chunks
        any_cold = cfg.cold_mode == "mean" and nC > 0 and bool(m.chunk_cold.any())
        s_w = qg @ self.k_hat[layer][:, :, None, :S].float().transpose(-1, -2) if any_warm else None
        if any_cold:
            lo, hi = cfg.sink, cfg.sink + nC * cfg.chunk
            Kc = K[:, :, lo:hi].reshape(B, nkv, nC, cfg.chunk, hd).mean(3)      # [B, nkv, nC, hd]
            Vc = V[:, :, lo:hi].reshape(B, nkv, nC, cfg.chunk, hd).mean(3)
            s_c = qg @ Kc[:, :, None].transpose(-1, -2)                          # [B, nkv, g, T, nC]
        fetched = chunk_fetched = None
        if cfg.budget and (any_warm or any_cold):
            fetched, chunk_fetched = self._route(layer, m, s_w, s_c if any_cold else None, start)
        # Which version of each key every query uses.
        use_ex = m.hot if fetched is None else (m.hot | fetched)                 # [.., T, S]
        parts_s = [s_ex.masked_fill(~use_ex, NEG_INF)]
        parts_v = [V]
        if any_warm:
            use_w = m.warm if fetched is None else (m.warm & ~fetched)
            parts_s.append(s_w.masked_fill(~use_w, NEG_INF))
            parts_v.append(self.v_hat[layer][:, :, :S].float() if cfg.value_format == "int8" else V)
        if any_cold:
            use_c = m.chunk_cold if chunk_fetched is None else (m.chunk_cold & ~chunk_fetched)
            parts_s.append((s_c + math.log(cfg.chunk)).masked_fill(~use_c, NEG_INF))
            parts_v.append(Vc)
        p = torch.softmax(torch.cat(parts_s, dim=-1), dim=-1)                     # [B, nkv, g, T, *]
        out, off = 0, 0
        for vals in parts_v:
            n = vals.shape[2]
            out = out + p[..., off:off + n] @ vals[:, :, None]
            off += n
        return out.reshape(B, nh, T, hd).to(q.dtype)

    def _route(self, layer, m, s_w, s_c, start):
        """Select, per (batch, KV head, query), the blocks with the largest predicted mass.
        Returns fetched [B, nkv, 1, T, S] and chunk_fetched [B, nkv, 1, T, nC] (bool)."""
        cfg = self.cfg
        B, nkv, g, T, _ = (s_w if s_w is not None else s_c).shape
        S, sink, bs = start + T, cfg.sink, cfg.block
        est = torch.full((B, nkv, g, T, S), NEG_INF, device=m.hot.device)
        if s_w is not None:
            est = torch.where(m.warm, s_w, est)
        if s_c is not None:
            nC = s_c.shape[-1]
            per_tok = torch.full_like(est, NEG_INF)
            per_tok[..., sink:sink + nC * cfg.chunk] = s_c.repeat_interleave(cfg.chunk, dim=-1)
            est = torch.where(m.cold, per_tok, est)
        nb = -(-(S - sink) // bs)
        region = torch.nn.functional.pad(est[..., sink:], (0, nb * bs - (S - sink)), value=NEG_INF)
        mass = torch.logsumexp(region.view(B, nkv, g, T, nb, bs), dim=(2, 5))   # [B, nkv, T, nb]
        k = min(cfg.budget // bs, nb)
        top = mass.topk(k, dim=-1)
        sel = torch.zeros_like(mass, dtype=torch.bool).scatter(-1, top.indices, top.values > NEG_INF)
        self.last_selection[layer] = sel
        sel_tok = sel.repeat_interleave(bs, dim=-1)[..., :S - sink]
        sel_tok = torch.nn.functional.pad(sel_tok, (sink, 0), value=False)[:, :, None]   # [B, nkv, 1, T, S]
        nonhot = m.warm | m.cold if s_c is not None else m.warm   # dropped tokens are not routable
        fetched = sel_tok & nonhot
        chunk_fetched = None
        if s_c is not None:
            blk_of_chunk = torch.arange(s_c.shape[-1], device=sel.device) * cfg.chunk // bs
            chunk_fetched = sel[..., blk_of_chunk][:, :, None]                  # [B, nkv, 1, T, nC]
        fb = fetch_bytes_per_token(cfg, self.model_cfg.head_dim)
        per_q = ((fetched & m.warm).sum((0, 1, 2, 4)).double() * fb["warm"]
                 + (fetched & m.cold).sum((0, 1, 2, 4)).double() * fb["cold"])   # [T]
        self.fetched_bytes_by_pos[start:S] += per_q.cpu()
        self.fetched_tokens_by_pos[start:S] += fetched.sum((0, 1, 2, 4)).double().cpu()
        return fetched, chunk_fetched

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
