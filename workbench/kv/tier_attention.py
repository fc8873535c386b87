"""The arithmetic both tiered caches share: compression of keys and values, and tiered attention.

:class:`~workbench.kv.tiers.TieredKVCache` (the *accounted* cache: every representation of every
token kept, bytes counted by formula) and :class:`~workbench.kv.tiers_physical.PhysicalTieredKVCache`
(only the resident zones kept, full blocks fetched from an offload tier) call the same
functions on the same values, so the physical cache reproduces the accounted one bit for bit:

* :func:`key_coefficients` / :func:`reconstruct_keys` - warm keys as rank-r PCA coefficients and
  back, in float64 and rounded once: the result for one token does not depend on how many
  tokens were compressed together (a step of 1 or a prefill of 256);
* :func:`int8_values` - warm values as int8 with one fp16 scale per token and head;
* :func:`chunk_means` - one mean key and value per cold chunk (float64, rounded once);
* :func:`route` - the blocks whose predicted attention mass is largest, per KV head and query;
* :func:`attend_zones` - softmax over [exact keys | warm reconstructions | cold summaries]; the
  caller supplies *dense views* (length S, one slot per position) and a ``fetch`` callback that
  fills the exact keys (and values) of the routed blocks before the exact scores are taken.

Positions a view does not hold are zeros and are masked out before the softmax, so they cannot
change a result: the accounted cache's views simply hold more.
"""

from __future__ import annotations

import math

import torch

from workbench.kv.tier_config import TierConfig, fetch_bytes_per_token
from workbench.model.decoder import apply_rope
from workbench.kv.pca import unrotate

NEG_INF = float("-inf")


def key_coefficients(k: torch.Tensor, mean: torch.Tensor, U: torch.Tensor, rope=None, dtype=None) -> torch.Tensor:
    """Rank-r coefficients [B, nkv, T, r] of keys k [B, nkv, T, hd] for one layer (``mean``
    [nkv, hd], ``U`` [nkv, hd, r]); ``rope`` = (cos, sin) undoes RoPE first (pre-RoPE basis)."""
    kk = k.double()
    if rope is not None:
        kk = unrotate(kk, rope[0].double(), rope[1].double())
    c = (kk - mean.double()[None, :, None]) @ U.double()[None]
    return c.to(dtype or torch.float32)


def reconstruct_keys(coef: torch.Tensor, mean: torch.Tensor, U: torch.Tensor, rope=None,
                     dtype=torch.float32) -> torch.Tensor:
    """Keys [B, nkv, T, hd] from coefficients [B, nkv, T, r]: ``mean + U c`` (then RoPE again
    for a pre-RoPE basis), in float64, rounded to ``dtype``."""
    rec = mean.double()[None, :, None] + coef.double() @ U.double()[None].transpose(-1, -2)
    if rope is not None:
        rec = apply_rope(rec, rope[0].double(), rope[1].double())
    return rec.to(dtype)


def int8_values(v: torch.Tensor):
    """(q int8, scale fp16 [.., 1], dequantised in v's dtype) with one scale per token and head."""
    scale = (v.float().abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    s = scale.float().clamp_min(torch.finfo(torch.float16).tiny)
    q = torch.round(v.float() / s).clamp(-127, 127).to(torch.int8)
    return q, scale, dequantise(q, scale, v.dtype)


def dequantise(q: torch.Tensor, scale: torch.Tensor, dtype) -> torch.Tensor:
    s = scale.float().clamp_min(torch.finfo(torch.float16).tiny)
    return (q.float() * s).to(dtype)


def chunk_means(x: torch.Tensor, chunk: int) -> torch.Tensor:
    """[B, nkv, n*chunk, hd] -> one mean per chunk [B, nkv, n, hd] (float64, rounded to x's dtype)."""
    B, nkv, T, hd = x.shape
    return x.double().reshape(B, nkv, T // chunk, chunk, hd).mean(3).to(x.dtype)


def route(cfg: TierConfig, m, s_w, s_c, start: int, head_dim: int):
    """Select, per (batch, KV head, query), the ``budget // block`` blocks of non-hot tokens with
    the largest predicted mass (``logsumexp`` of the approximate logits over the block's tokens
    and the GQA group's query heads).  Returns ``sel`` [B, nkv, T, nb] (blocks from ``sink``),
    ``fetched`` [B, nkv, 1, T, S], ``chunk_fetched`` [B, nkv, 1, T, nC] or None, and the bytes
    the selection needs from the offload tier per query position [T] (float64)."""
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
    sel_tok = sel.repeat_interleave(bs, dim=-1)[..., :S - sink]
    sel_tok = torch.nn.functional.pad(sel_tok, (sink, 0), value=False)[:, :, None]   # [B, nkv, 1, T, S]
    nonhot = m.warm | m.cold if s_c is not None else m.warm   # dropped tokens are not routable
    fetched = sel_tok & nonhot
    chunk_fetched = None
    if s_c is not None:
        blk_of_chunk = torch.arange(s_c.shape[-1], device=sel.device) * cfg.chunk // bs
        chunk_fetched = sel[..., blk_of_chunk][:, :, None]                  # [B, nkv, 1, T, nC]
    fb = fetch_bytes_per_token(cfg, head_dim)
    per_q = ((fetched & m.warm).sum((0, 1, 2, 4)).double() * fb["warm"]
             + (fetched & m.cold).sum((0, 1, 2, 4)).double() * fb["cold"])   # [T]
    return sel, fetched, chunk_fetched, per_q


def attend_zones(cfg: TierConfig, q: torch.Tensor, start: int, m, K: torch.Tensor, V: torch.Tensor,
                 k_hat: torch.Tensor | None, v_warm: torch.Tensor | None, Kc: torch.Tensor | None,
                 Vc: torch.Tensor | None, fetch=None, on_route=None) -> torch.Tensor:
    """Tiered attention of q [B, nh, T, hd] at positions start..start+T-1 over dense views of
    S = start + T positions: ``K``/``V`` exact (read only where hot or fetched), ``k_hat`` warm
    key reconstructions, ``v_warm`` warm values (V itself for ``value_format="full"``),
    ``Kc``/``Vc`` [B, nkv, nC, hd] cold-chunk summaries (read only where the chunk is cold).
    ``fetch(fetched)`` runs after routing, before the exact scores, and must fill ``K``/``V``
    where ``fetched`` [B, nkv, 1, T, S] is set; ``on_route(sel, per_q)`` sees the selection."""
    B, nh, T, hd = q.shape
    nkv = K.shape[1]
    g = nh // nkv
    qg = q.float().view(B, nkv, g, T, hd) / math.sqrt(hd)
    nC = m.n_chunks
    # from the host when the masks know it (zone_masks): no device sync per layer
    any_warm = m.any_warm if m.any_warm is not None else bool(m.warm.any())
    any_cold = cfg.cold_mode == "mean" and nC > 0 and (m.any_chunk_cold if m.any_chunk_cold is not None
                                                       else bool(m.chunk_cold.any()))
    s_w = qg @ k_hat.float()[:, :, None].transpose(-1, -2) if any_warm else None
    s_c = qg @ Kc.float()[:, :, None].transpose(-1, -2) if any_cold else None      # [B, nkv, g, T, nC]
    fetched = chunk_fetched = None
    if cfg.budget and (any_warm or any_cold):
        sel, fetched, chunk_fetched, per_q = route(cfg, m, s_w, s_c, start, hd)
        if on_route is not None:
            on_route(sel, per_q)
        if fetch is not None:
            fetch(fetched)
    s_ex = qg @ K.float()[:, :, None].transpose(-1, -2)                              # [B, nkv, g, T, S]
    use_ex = m.hot if fetched is None else (m.hot | fetched)
    parts_s, parts_v = [s_ex.masked_fill(~use_ex, NEG_INF)], [V.float()]
    if any_warm:
        use_w = m.warm if fetched is None else (m.warm & ~fetched)
        parts_s.append(s_w.masked_fill(~use_w, NEG_INF))
        parts_v.append(v_warm.float())
    if any_cold:
        use_c = m.chunk_cold if chunk_fetched is None else (m.chunk_cold & ~chunk_fetched)
        parts_s.append((s_c + math.log(cfg.chunk)).masked_fill(~use_c, NEG_INF))
        parts_v.append(Vc.float())
    p = torch.softmax(torch.cat(parts_s, dim=-1), dim=-1)                          # [B, nkv, g, T, *]
    out, off = 0, 0
    for vals in parts_v:
        n = vals.shape[2]
        out = out + p[..., off:off + n] @ vals[:, :, None]
        off += n
    return out.reshape(B, nh, T, hd).to(q.dtype)
