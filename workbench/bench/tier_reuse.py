"""Cold-zone reuse of the tiered KV cache next to its quality: does a low reuse rate mark the
settings that lose quality?

::

    rows = reuse_sweep(model, basis, sequences, [TierConfig(...), ...], eval_tokens=256)
    rows[0]["cold_reuse"], rows[0]["rel_ppl"], rows[0]["rel_ppl_se"], rows[0]["loses_quality"]

**Cold-zone reuse** (the articles' kv-inspector counts "the share of the cache reused over the last
3 generations"; here it is measured on the package's own routing, :func:`workbench.kv.tier_attention.route`):
for a query at position p, a layer and a KV head, the cold tokens at p (:func:`~workbench.kv.tier_config.zone_masks`)
that routing fetched back exactly -- its selected blocks -- for p or one of the ``last - 1`` queries
before it, over the cold tokens at p.  ``cold_reuse`` is its mean over the scored queries, layers
and KV heads (queries with no cold token are skipped); ``cold_reuse_now`` is the same with
``last = 1`` (the query's own selection: what :func:`workbench.kv.tier_inspect.tier_report` shows
as "fetched").  A configuration without routing (``budget=None``) fetches nothing: reuse 0.

**Quality**, against the full cache on the same tokens (as :func:`workbench.bench.tier_eval.evaluate_config`
defines it): ``rel_ppl`` = ppl / ppl_full - 1 with ``rel_ppl_se`` from the paired per-token NLL
differences, ``kl`` = mean KL(full || tiered), ``top1`` = argmax agreement; ``loses_quality`` when
``rel_ppl > 2 rel_ppl_se`` (beyond the noise of the paired differences).

Both come from one pass of each window through the tiered cache (:func:`~workbench.bench.tier_eval.tiered_logits`,
segments of ``segment`` tokens).  The cache keeps the routing selections of its last forward
(``last_selection``), so reuse is measured over the last ``min(eval_tokens, last segment)`` query
positions of each window -- the scored ones, give or take the window's last position.
"""

from __future__ import annotations

import dataclasses
import math
import time

import torch

from workbench.bench.tier_eval import reference_logits, tiered_logits
from workbench.errors import ConfigError
from workbench.kv.tier_config import TierConfig, zone_masks


def cold_reuse(cache, length: int, queries: int, last: int = 3) -> dict:
    """Reuse of the cold zone by routing for the last ``queries`` query positions of a
    :class:`~workbench.kv.tiers.TieredKVCache` that holds ``length`` tokens (its last forward
    computed at least those queries; the ``last - 1`` queries before each count when that forward
    computed them).  Returns ``{"reuse": mean, "per_layer": [...], "queries": n}`` (``reuse`` None
    when no query had a cold token)."""
    cfg = cache.cfg
    m = zone_masks(length - queries, queries, cfg)
    cold = m.cold if cfg.cold_mode == "mean" else torch.zeros_like(m.cold)     # [Q, S]
    n_cold = cold.sum(-1)                                                       # [Q]
    ok = n_cold > 0
    per_layer: list[float | None] = []
    for layer in range(cache.model_cfg.num_hidden_layers):
        sel = cache.last_selection.get(layer)
        if not ok.any():
            per_layer.append(None)
            continue
        if sel is None:                                 # no routing: nothing fetched back
            per_layer.append(0.0)
            continue
        T = sel.shape[2]                                # the queries of the cache's last forward
        if T < queries:
            raise ConfigError(f"cold_reuse: the cache's last forward computed {T} queries, fewer than "
                              f"the {queries} asked for (score within one segment)")
        tok = sel.repeat_interleave(cfg.block, dim=-1)[..., :length - cfg.sink]
        tok = torch.nn.functional.pad(tok, (cfg.sink, 0), value=False)          # [B, nkv, T, S]
        union = tok.clone()
        for d in range(1, last):                                                # selections of the queries before
            union[:, :, d:] |= tok[:, :, :-d]
        hit = (union[:, :, T - queries:] & cold).sum(-1)                        # [B, nkv, Q]
        frac = hit[..., ok].double() / n_cold[ok].double()
        per_layer.append(float(frac.mean()))
    vals = [v for v in per_layer if v is not None]
    return {"reuse": sum(vals) / len(vals) if vals else None, "per_layer": per_layer, "queries": int(ok.sum())}


@torch.no_grad()
def reuse_sweep(model, basis, sequences, configs, eval_tokens: int = 256, segment: int = 256, last: int = 3,
                reference=None) -> list[dict]:
    """One row per configuration: cold-zone reuse and quality (see the module docstring).
    ``basis``: a PCA basis or ``{key_space: basis}``; ``reference``: full-cache logits per sequence
    (:func:`~workbench.bench.tier_eval.reference_logits`; computed when None)."""
    reference = reference if reference is not None else reference_logits(model, sequences)
    rows = []
    for c in configs:
        cfg = c if isinstance(c, TierConfig) else TierConfig(**c)
        b = basis.get(cfg.key_space) if isinstance(basis, dict) else basis
        t0 = time.perf_counter()
        nll_t = nll_f = kl = agree = n = 0.0
        dnll, reuse, now, cold_tokens = [], [], [], []
        for seq, ref in zip(sequences, reference):
            N = len(seq)
            E = min(eval_tokens, N - 1)
            logits, cache = tiered_logits(model, cfg, b, seq, segment, keep_from=N - E - 1)
            Q = min(E, N - (N - 1) // segment * segment)      # the last segment's queries (its routing is kept)
            r_all, r_now = cold_reuse(cache, N, Q, last), cold_reuse(cache, N, Q, 1)
            reuse.append(r_all["reuse"])
            now.append(r_now["reuse"])
            m = zone_masks(N - 1, 1, cfg)
            cold_tokens.append(int(m.cold.sum()) if cfg.cold_mode == "mean" else 0)
            logits = logits[:-1]
            rows_ = slice(N - E - 1, N - 1)
            targets = torch.as_tensor(list(seq)[N - E:], device=logits.device)
            lp_t, lp_f = torch.log_softmax(logits, -1), torch.log_softmax(ref[rows_], -1)
            tok_t = -lp_t.gather(1, targets[:, None])[:, 0]
            tok_f = -lp_f.gather(1, targets[:, None])[:, 0]
            nll_t += float(tok_t.sum())
            nll_f += float(tok_f.sum())
            dnll.append((tok_t - tok_f).double().cpu())
            kl += float((lp_f.exp() * (lp_f - lp_t)).sum())
            agree += float((lp_t.argmax(-1) == lp_f.argmax(-1)).sum())
            n += E
        ratio = math.exp(nll_t / n) / math.exp(nll_f / n)
        d = torch.cat(dnll)
        se = ratio * float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else float("nan")
        valid = [x for x in reuse if x is not None]
        valid_now = [x for x in now if x is not None]
        rows.append({"name": cfg.name, **{k: getattr(cfg, k) for k in ("window", "warm_tokens", "budget", "rank",
                                                                         "chunk", "block", "key_space")},
                     "cold_tokens_at_end": sum(cold_tokens) / len(cold_tokens),
                     "cold_reuse": sum(valid) / len(valid) if valid else None,
                     "cold_reuse_now": sum(valid_now) / len(valid_now) if valid_now else None,
                     "rel_ppl": ratio - 1, "rel_ppl_se": se, "kl": kl / n, "top1": agree / n,
                     "loses_quality": bool(ratio - 1 > 2 * se), "scored_tokens": int(n),
                     "seconds": time.perf_counter() - t0, "config": dataclasses.asdict(cfg)})
    return rows


__all__ = ["cold_reuse", "reuse_sweep"]
