"""kv-inspect of the tiered cache: zones, key norms, bytes and a per-position zone map of a
:class:`~workbench.kv.tiers.TieredKVCache`, as plain data (:mod:`workbench.kv.inspect` has the
paged pool's reports and :func:`~workbench.kv.inspect.report` for any engine).  ::

    llm = LLM(tiers=TierConfig(...), tier_basis=basis)
    llm.generate([long_prompt], params)
    tier_report(llm.last_cache)             # zones per layer, key norms per zone, bytes, zone map
    tier_frame(llm.last_cache)

A report reads the cache at its current length ``n``, i.e. as its last query (position
``n - 1``) sees it.  Per layer and sequence (batch rows share the zone arithmetic of
:mod:`~workbench.kv.tier_config`):

* ``hot`` / ``warm`` / ``cold``: tokens per zone (``hot + warm + cold == n``);
* ``dropped``: cold tokens with ``cold_mode="drop"`` (evicted: neither attended nor fetchable);
* ``offloaded``: tokens whose full-precision K/V lives *only* in the offload tier, i.e. every
  token that is not hot and not dropped (``warm + cold`` with ``cold_mode="mean"``);
* ``fetched``: offloaded tokens that routing fetched back exactly for the last query, per KV
  head (routing picks blocks per head; the table shows the mean and max over heads).

Key L2 norms per zone, from the cache's own tensors: full-precision keys of hot tokens, PCA
reconstructions of warm keys (with the full keys' norm and the relative reconstruction error
next to them), and the chunk-mean keys of cold chunks - each over tokens (or chunks), KV heads
and batch rows.
"""

from __future__ import annotations

import dataclasses

import torch

from workbench.kv.tier_config import zone_masks


def _norm_stats(k: torch.Tensor) -> dict:
    """Mean / max L2 norm over the last dim of k [..., hd] (None when empty)."""
    if k.numel() == 0:
        return {"mean": None, "max": None, "n": 0}
    n = k.float().norm(dim=-1)
    return {"mean": float(n.mean()), "max": float(n.max()), "n": int(n.numel())}


def _fetched_tokens(cache, layer: int, n: int, routable: torch.Tensor) -> torch.Tensor | None:
    """[B, nkv, n] bool: offloaded tokens routing fetched for the query at n-1, or None when no
    routing ran.  Routing blocks of ``block`` tokens start at ``sink``; once a query has any
    warm or cold token, every later call routes, so the last selection is the last query's."""
    cfg = cache.cfg
    sel = cache.last_selection.get(layer)
    if sel is None or n <= cfg.sink:
        return None
    if sel.shape[-1] != -(-(n - cfg.sink) // cfg.block):
        return None                                 # a selection for another length: not this query's
    tok = sel[:, :, -1].repeat_interleave(cfg.block, dim=-1)[..., :n - cfg.sink]   # [B, nkv, n - sink]
    tok = torch.nn.functional.pad(tok, (cfg.sink, 0), value=False)
    return tok & routable.to(tok.device)


def _bytes(cache, z) -> dict:
    """Resident bytes: the accounted cache's formula, or the physical cache's measured storage."""
    if getattr(cache, "physical", False):
        mem = cache.memory()
        return {"resident": mem["resident_kv"], "full": mem["full"], "basis": mem["measured"]["basis"],
                "staging": mem["measured"]["staging"], "offloaded_tier": mem["offloaded"], "measured": True,
                "element_bytes": torch.empty((), dtype=cache.dtype).element_size()}
    return {"resident": cache.resident_bytes(), "full": cache.full_resident_bytes(),
            "basis": cache.basis_bytes() if z.warm else 0, "element_bytes": cache.cfg.element_bytes, "measured": False}


@torch.no_grad()
def tier_report(cache, zone_map: bool = True) -> dict:
    """Zones, key norms, bytes and the per-position zone map of a TieredKVCache (JSON-ready;
    definitions in the module docstring).  A PhysicalTieredKVCache reports its measured bytes
    and no key norms (it keeps no full keys)."""
    cfg, mc, n = cache.cfg, cache.model_cfg, cache.length
    z = cache.zone_counts()
    drop = cfg.cold_mode == "drop"
    rep = {"mode": "tiered", "config": dataclasses.asdict(cfg), "config_name": cfg.name, "length": n,
           "batch_size": cache.batch_size, "num_layers": mc.num_hidden_layers, "num_kv_heads": mc.num_key_value_heads,
           "zones": {"hot": z.hot, "warm": z.warm, "cold": z.cold_tokens, "cold_chunks": z.cold_chunks,
                     "dropped": z.cold_tokens if drop else 0,
                     "offloaded": n - z.hot - (z.cold_tokens if drop else 0)},
           "bytes": _bytes(cache, z) | {
                     "fetched_last_step": float(cache.fetched_bytes_by_pos[n - 1]) if n else 0.0,
                     "fetched_tokens_last_step": (float(cache.fetched_tokens_by_pos[n - 1])
                                                  if n and hasattr(cache, "fetched_tokens_by_pos") else None)}}
    rep["bytes"]["reduction"] = rep["bytes"]["full"] / rep["bytes"]["resident"] if rep["bytes"]["resident"] else None
    layers, zmap, fheads = [], [], []
    if n:
        m = zone_masks(n - 1, 1, cfg)
        hot, warm, cold = m.hot[0], m.warm[0], m.cold[0]            # [n] bool, for the last query
        routable = warm | (cold if not drop else torch.zeros_like(cold))
        chunk_cold = m.chunk_cold[0]
    for layer in range(mc.num_hidden_layers):
        row = {"layer": layer, "hot": z.hot, "warm": z.warm, "cold": z.cold_tokens, "cold_chunks": z.cold_chunks,
               "dropped": rep["zones"]["dropped"], "offloaded": rep["zones"]["offloaded"]}
        if not n:
            layers.append(row)
            continue
        f = _fetched_tokens(cache, layer, n, routable)
        per_head = [0] * mc.num_key_value_heads if f is None else f.sum(-1).sum(0).tolist()   # summed over batch
        row.update({"fetched": sum(per_head) / len(per_head) / cache.batch_size,
                    "fetched_max_head": max(per_head) / cache.batch_size if per_head else 0,
                    "fetched_by_head": per_head})
        if zone_map:
            names = ["hot" if h else "dropped" if (c and drop) else "cold" if c else "warm"
                     for h, c in zip(hot.tolist(), cold.tolist())]
            heads = [0] * n if f is None else f[0].sum(0).tolist()  # batch row 0: KV heads fetching each token
            zmap.append(["fetched" if k else s for s, k in zip(names, heads)])
            fheads.append(heads)
        layers.append(row)
        if getattr(cache, "physical", False):
            continue                      # the physical cache keeps no full keys to take norms of
        K = cache.k[layer][:, :, :n]                                # [B, nkv, n, hd]
        norms = {"hot": _norm_stats(K[:, :, hot])}
        if z.warm:
            norms["warm"] = _norm_stats(cache.k_hat[layer][:, :, :n][:, :, warm])
            norms["warm_exact"] = _norm_stats(K[:, :, warm])
            kw, kh = K[:, :, warm].float(), cache.k_hat[layer][:, :, :n][:, :, warm].float()
            rel = (kw - kh).norm(dim=-1) / kw.norm(dim=-1).clamp_min(1e-12)
            norms["warm_rel_error"] = float(rel.mean())
        else:
            norms["warm"] = norms["warm_exact"] = _norm_stats(K[:, :, :0])
            norms["warm_rel_error"] = None
        nC = int(chunk_cold.sum())
        if nC and not drop:
            lo = cfg.sink
            chunks = K[:, :, lo:lo + nC * cfg.chunk].reshape(*K.shape[:2], nC, cfg.chunk, K.shape[-1]).mean(3)
            norms["cold"] = _norm_stats(chunks)
        else:
            norms["cold"] = _norm_stats(K[:, :, :0])
        row["key_norms"] = norms
    rep["layers"] = layers
    if zone_map:
        rep["zone_map"] = zmap            # [layer][position] -> zone name (fetched by >= 1 KV head: "fetched")
        rep["fetched_heads"] = fheads     # [layer][position] -> KV heads that fetched it (batch row 0)
    return rep


def tier_frame(cache_or_report):
    """Per-layer table of a tier report: zone counts, fetched tokens, key norms per zone."""
    import pandas as pd  # lazy: pandas (~1 s) only for this table

    rep = cache_or_report if isinstance(cache_or_report, dict) else tier_report(cache_or_report, zone_map=False)
    rows = []
    for r in rep["layers"]:
        row = {k: r[k] for k in ("layer", "hot", "warm", "cold", "cold_chunks", "dropped", "offloaded")}
        row["fetched"] = r.get("fetched", 0)
        for zone in ("hot", "warm", "cold"):
            s = r.get("key_norms", {}).get(zone, {})
            row[f"|k| {zone} mean"], row[f"|k| {zone} max"] = s.get("mean"), s.get("max")
        row["warm rel err"] = r.get("key_norms", {}).get("warm_rel_error")
        rows.append(row)
    return pd.DataFrame(rows).set_index("layer")
