"""Measure a tiered-cache configuration against the full cache: memory, perplexity, KL, top-1.

What is evaluated (one row per configuration)::

    documents   the evaluation half of heldout_split(): first `context` tokens of each (1,024 for
                the bundled model); the PCA basis is fitted on the *other* half (whole documents)
    forward     the whole window in segments through the tiered cache: every query position sees
                the cache exactly as token-by-token teacher-forced decoding would have it (the
                zones, compression and routing are computed per query; the K/V of later tokens
                come from hidden states computed with tiered attention, so errors compound as in
                real decoding).  check_sequential() verifies this equality on the real model.
    scored      the next-token predictions for the last `eval_tokens` targets of each window
                (logits at positions N-E-1 .. N-2 predict tokens N-E .. N-1)
    reference   the same model, same tokens, no cache compression (plain causal forward)

Metrics: ``bytes_per_token`` = mean over the scored query positions p of
resident_bytes(p+1) / (p+1) (PCA basis included); ``reduction`` = full / tiered bytes per
token; ``reduction_at_end`` at the full window; ``ppl`` / ``ppl_full`` pooled over scored
tokens; ``rel_ppl`` = ppl / ppl_full - 1 and ``rel_ppl_se`` its standard error from the paired
per-token NLL differences (tokens of one document are correlated: read it as a lower bound on
the noise); ``kl`` = mean KL(full || tiered) in nats; ``top1`` = fraction of positions whose
argmax agrees; ``fetched_per_step`` = mean bytes routing moved from the offload tier per decode
step (one sequence, all layers and heads) and ``fetched_frac`` the same as a fraction of the
full cache's bytes at that step.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
import traceback

import torch

from workbench.data import heldout_split  # noqa: F401  (its home is workbench.data; imported from here too)
from workbench.errors import WorkbenchError
from workbench.model.decoder import CausalLM
from workbench.kv.pca import PCABasis
from workbench.kv.tier_config import TierConfig, full_bytes_per_token, resident_bytes, zone_counts
from workbench.kv.tiers import TieredKVCache, tiered_attention


def _as_ids(seq, device) -> torch.Tensor:
    return torch.as_tensor(list(seq), dtype=torch.long, device=device)[None]


@torch.no_grad()
def reference_logits(model: CausalLM, sequences) -> list[torch.Tensor]:
    """Full-precision logits [N, V] per sequence (computed once, shared by every config)."""
    return [model(_as_ids(s, model.device))[0].float() for s in sequences]


@torch.no_grad()
def tiered_logits(model: CausalLM, cfg: TierConfig, basis: PCABasis | None, seq, segment: int = 256,
                  keep_from: int = 0):
    """Logits [N - keep_from, V] (positions keep_from .. N-1) of one sequence run through a
    fresh :class:`TieredKVCache` in segments of ``segment`` tokens, and the cache."""
    ids = _as_ids(seq, model.device)
    N = ids.shape[1]
    cache = TieredKVCache(model.config, cfg, basis, max_len=N, device=model.device,
                          dtype=model.lm_head.weight.dtype)
    outs = []
    with tiered_attention(model):
        for s in range(0, N, segment):
            e = min(s + segment, N)
            keep = e - max(s, keep_from)          # LM head only where logits are wanted
            out = model(ids[:, s:e], start_pos=s, cache=cache, logits_to_keep=max(keep, 1))
            if keep > 0:
                outs.append(out[0].float())
    return torch.cat(outs), cache


@torch.no_grad()
def check_sequential(model: CausalLM, cfg: TierConfig, basis, seq, tail: int = 32) -> float:
    """Max |logit difference| between one-pass evaluation and true step-by-step decoding of
    the last ``tail`` tokens (prefix prefilled through the same tiered cache)."""
    full, _ = tiered_logits(model, cfg, basis, seq)
    ids = _as_ids(seq, model.device)
    N = ids.shape[1]
    cache = TieredKVCache(model.config, cfg, basis, max_len=N, device=model.device,
                          dtype=model.lm_head.weight.dtype)
    with tiered_attention(model):
        model(ids[:, :N - tail], cache=cache)
        steps = [model(ids[:, i:i + 1], start_pos=i, cache=cache)[0, -1].float() for i in range(N - tail, N)]
    return float((torch.stack(steps) - full[N - tail:]).abs().max())


def evaluate_config(model: CausalLM, cfg: TierConfig, basis: PCABasis | None, sequences,
                    eval_tokens: int = 512, reference: list[torch.Tensor] | None = None,
                    segment: int = 256) -> dict:
    """Metrics of one configuration over ``sequences`` (see the module docstring)."""
    if reference is None:
        reference = reference_logits(model, sequences)
    mc = model.config
    L, nkv, hd = mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim
    full_bpt = full_bytes_per_token(L, nkv, hd, cfg.element_bytes)
    nll_t = nll_f = kl = agree = n = 0.0
    bpt, bpt_end, fetched, fetched_frac, dnll = [], [], [], [], []
    t0 = time.perf_counter()
    for seq, ref in zip(sequences, reference):
        N = len(seq)
        E = min(eval_tokens, N - 1)
        logits, cache = tiered_logits(model, cfg, basis, seq, segment, keep_from=N - E - 1)
        logits = logits[:-1]                              # query positions N-E-1 .. N-2 are scored
        rows = slice(N - E - 1, N - 1)
        targets = torch.as_tensor(list(seq)[N - E:], device=logits.device)
        lp_t = torch.log_softmax(logits, -1)
        lp_f = torch.log_softmax(ref[rows], -1)
        tok_t, tok_f = -lp_t.gather(1, targets[:, None])[:, 0], -lp_f.gather(1, targets[:, None])[:, 0]
        nll_t += float(tok_t.sum())
        nll_f += float(tok_f.sum())
        dnll.append((tok_t - tok_f).double().cpu())
        kl += float((lp_f.exp() * (lp_f - lp_t)).sum())
        agree += float((lp_t.argmax(-1) == lp_f.argmax(-1)).sum())
        n += E
        bpt += [resident_bytes(p + 1, cfg, L, nkv, hd) / (p + 1) for p in range(N - E - 1, N - 1)]
        bpt_end.append(resident_bytes(N, cfg, L, nkv, hd) / N)
        fetched += cache.fetched_bytes_by_pos[N - E - 1:N - 1].tolist()
        fetched_frac += [cache.fetched_bytes_by_pos[p].item() / (full_bpt * (p + 1))
                         for p in range(N - E - 1, N - 1)]
    ppl, ppl_full = math.exp(nll_t / n), math.exp(nll_f / n)
    d = torch.cat(dnll)
    se = float(d.std() / math.sqrt(d.numel())) if d.numel() > 1 else float("nan")
    z = zone_counts(len(sequences[-1]), cfg)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {"bytes_per_token": mean(bpt), "full_bytes_per_token": full_bpt,
            "reduction": full_bpt / mean(bpt), "reduction_at_end": full_bpt / mean(bpt_end),
            "ppl": ppl, "ppl_full": ppl_full, "rel_ppl": ppl / ppl_full - 1,
            "rel_ppl_se": (ppl / ppl_full) * se, "kl": kl / n, "top1": agree / n,
            "fetched_per_step": mean(fetched), "fetched_frac": mean(fetched_frac),
            "hot_end": z.hot, "warm_end": z.warm, "cold_tokens_end": z.cold_tokens, "scored_tokens": int(n),
            "seconds": time.perf_counter() - t0}


def grid_configs(base: TierConfig | None = None, **grid) -> list[dict]:
    """Field dicts for the product of ``grid`` values over ``base`` (not yet validated, so a
    bad combination is recorded by :func:`sweep` instead of stopping it)."""
    base = dataclasses.asdict(base or TierConfig())
    keys = list(grid)
    return [dict(base, **dict(zip(keys, vals))) for vals in itertools.product(*(grid[k] for k in keys))]


def sweep(model: CausalLM, basis, sequences, configs, eval_tokens: int = 512, progress=None):
    """Evaluate every configuration; return a DataFrame, one row per config, failures kept.

    ``configs``: TierConfigs or field dicts (see :func:`grid_configs`).  ``basis``: a
    :class:`PCABasis` or ``{key_space: PCABasis}``.  A config that fails (invalid fields, a
    rank above the basis, a runtime error) gets a row with the ``error`` column set and the
    sweep goes on.
    """
    import pandas as pd

    reference = reference_logits(model, sequences)
    rows = []
    for i, c in enumerate(configs):
        fields = dataclasses.asdict(c) if isinstance(c, TierConfig) else dict(c)
        row = dict(fields, name=None, error=None)
        try:
            cfg = c if isinstance(c, TierConfig) else TierConfig(**fields)
            row["name"] = cfg.name
            b = basis.get(cfg.key_space) if isinstance(basis, dict) else basis
            row.update(evaluate_config(model, cfg, b, sequences, eval_tokens, reference))
        except Exception as e:  # noqa: BLE001 - record every failure, keep sweeping
            row["error"] = f"{type(e).__name__}: {e}"
            if not isinstance(e, WorkbenchError):
                row["error"] += " | " + traceback.format_exc(limit=2).strip().splitlines()[-1]
        rows.append(row)
        if progress:
            progress(i, row)
    return pd.DataFrame(rows)


def pareto_front(df, x: str = "reduction", y: str = "rel_ppl"):
    """Rows not dominated in (maximise ``x``, minimise ``y``), sorted by ``x``; failures dropped."""
    ok = df[df["error"].isna()] if "error" in df else df
    ok = ok.dropna(subset=[x, y]).sort_values([x, y], ascending=[False, True])
    keep, best_y = [], float("inf")
    for idx, row in ok.iterrows():
        if row[y] < best_y:
            keep.append(idx)
            best_y = row[y]
    return ok.loc[keep].sort_values(x)


def best_under(df, max_rel_ppl: float = 0.02, x: str = "reduction"):
    """The rows with the largest memory reduction whose relative perplexity increase is at most
    ``max_rel_ppl`` (empty if none)."""
    ok = df[df["error"].isna()] if "error" in df else df
    ok = ok[ok["rel_ppl"] <= max_rel_ppl]
    return ok.sort_values(x, ascending=False)
