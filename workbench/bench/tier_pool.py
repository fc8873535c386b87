"""Tiers on the paged pool: the design, and what its new pieces cost, measured on this device.

Today the tiered cache (:mod:`workbench.kv.tiers`, :mod:`workbench.kv.tiers_physical`) keeps a cache
*per sequence*, and the engine refuses it with the paged pool (``kv=`` and ``tiers=``) and with the
static decode step (``compile`` / ``cuda_graphs``): its routing picks blocks on the host at every
step and layer, in Python, so no static step can replay it and no block can be shared.  The design
that would put it on the pool::

    hot     the sink block and the blocks of the last ``window`` tokens: ordinary pool blocks, read in
            place by the paged step; shared prefixes stay shared (the block manager does not change)
    leave   when a block leaves every sequence's window it is summarised once, keyed by its hash
            (so a shared system prompt is summarised once for every conversation on it): rank-r PCA
            coefficients of its keys and int8 values with a scale per token and head (warm), and its
            full K / V go to the offload tier (host memory; the pool slot is freed)
    step    one static call per layer: approximate scores of every warm token from the coefficients
            (q.k^ = q.mean + (qU).c), each block's mass (logsumexp over its tokens and the GQA
            group), the top ``budget`` blocks per row (``topk``: a static shape), their exact K / V
            read from the offload tier through a block table, one softmax over [hot exact | routed
            exact | the other warm tokens approximate]

Everything in ``step`` has static shapes (the warm table padded, ``topk`` of a fixed budget), so it
compiles and captures; on a GPU the routed blocks would be read from pinned host memory by the
kernel itself (zero-copy over the host link: a captured graph cannot launch copies that depend on
routing), which this CPU cannot measure.  :func:`tier_pool_cost` measures the two new pieces here:

* **summarise**: turning one block (every layer) into its warm summary, once per block;
* **step**: the tiered decode attention above (:func:`pooled_tiered_attention`, ``torch.compile``'d),
  against the exact paged attention over every block (``attention_decode_torch``, compiled),
  per layer, at several contexts and batches; and the bytes each keeps resident per token.

It is a cost model of the design, not the feature: the engine still refuses tiers with the pool.
"""

from __future__ import annotations

import math
import statistics
import time

import torch

from workbench.kv.tier_attention import int8_values, key_coefficients


def pooled_tiered_attention(q, k_cache, v_cache, hot_tables, warm_tables, coef, v_int8, v_scale, mean, U,
                            host_k, host_v, budget_blocks: int):
    """One decode token per row, one layer.  q [B, nh, hd]; ``k_cache`` / ``v_cache`` the pool
    [num_blocks, bs, nkv, hd] (hot blocks, read through ``hot_tables`` [B, Wb]); ``coef`` [num_blocks,
    bs, nkv, r], ``v_int8`` [num_blocks, bs, nkv, hd] and ``v_scale`` [num_blocks, bs, nkv, 1] the warm
    summaries and ``host_k`` / ``host_v`` the offload tier's full blocks, all read through
    ``warm_tables`` [B, Nw]; ``mean`` [nkv, hd] and ``U`` [nkv, hd, r] the layer's PCA basis.  The top
    ``budget_blocks`` warm blocks of each row (by predicted mass) are attended exactly, the others
    approximately.  Every hot and warm slot is valid (the caller pads with blocks of zeros, which only
    dilute: a cost model).  -> [B, nh, hd]."""
    B, nh, hd = q.shape
    nkv, bs = k_cache.shape[2], k_cache.shape[1]
    g, Wb, Nw = nh // nkv, hot_tables.shape[1], warm_tables.shape[1]
    qg = q.view(B, nkv, g, hd).float() * (1.0 / math.sqrt(hd))
    hot = hot_tables.long()
    kh = k_cache[hot].reshape(B, Wb * bs, nkv, 1, hd).float()
    s_hot = (qg[:, None] * kh).sum(-1)                                              # [B, Sh, nkv, g]
    warm = warm_tables.long()
    qu = torch.einsum("bkgd,kdr->bkgr", qg, U.float())                              # [B, nkv, g, r]
    qm = torch.einsum("bkgd,kd->bkg", qg, mean.float())                             # [B, nkv, g]
    c = coef[warm].float()                                                          # [B, Nw, bs, nkv, r]
    s_warm = (qu[:, None, None] * c[..., None, :]).sum(-1) + qm[:, None, None]     # [B, Nw, bs, nkv, g]
    mass = torch.logsumexp(s_warm.reshape(B, Nw, -1), dim=-1)                       # [B, Nw]
    top = mass.topk(budget_blocks, dim=-1).indices                                  # [B, kb]
    routed = warm.gather(1, top)                                                    # physical blocks
    kr = host_k[routed].reshape(B, budget_blocks * bs, nkv, 1, hd).float()
    s_routed = (qg[:, None] * kr).sum(-1)                                           # [B, Sr, nkv, g]
    was_routed = torch.zeros(B, Nw, dtype=torch.bool, device=q.device).scatter(1, top, True)
    s_warm = s_warm.masked_fill(was_routed[:, :, None, None, None], float("-inf")).reshape(B, Nw * bs, nkv, g)
    p = torch.softmax(torch.cat([s_hot, s_routed, s_warm], dim=1), dim=1)           # [B, S*, nkv, g]
    Sh, Sr = Wb * bs, budget_blocks * bs
    vh = v_cache[hot].reshape(B, Sh, nkv, 1, hd).float()
    vr = host_v[routed].reshape(B, Sr, nkv, 1, hd).float()
    vw = (v_int8[warm].float() * v_scale[warm].float()).reshape(B, Nw * bs, nkv, 1, hd)
    out = ((p[:, :Sh, ..., None] * vh).sum(1) + (p[:, Sh:Sh + Sr, ..., None] * vr).sum(1)
           + (p[:, Sh + Sr:, ..., None] * vw).sum(1))                               # [B, nkv, g, hd]
    return out.reshape(B, nh, hd).to(q.dtype)


def _time(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e6


def summarize_block_us(model, rank: int, block_size: int, repeats: int = 20) -> float:
    """Microseconds to summarise one block of every layer: PCA coefficients of its keys and int8
    values (what a block leaving every window would cost once, per block hash)."""
    cfg = model.config
    nkv, hd, L = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(1, nkv, block_size, hd, generator=gen)
    v = torch.randn(1, nkv, block_size, hd, generator=gen)
    mean, U = torch.zeros(nkv, hd), torch.linalg.qr(torch.randn(nkv, hd, rank, generator=gen)).Q

    def once():
        for _ in range(L):
            key_coefficients(k, mean, U)
            int8_values(v)

    return _time(once, repeats)


def tier_pool_cost(model=None, contexts=(256, 1024, 4096), batches=(1, 8), window: int = 64, rank: int = 8,
                   budget: int = 64, block_size: int = 16, repeats: int = 30) -> dict:
    """The design's costs on this device (see the module docstring): per (context, batch), the
    compiled tiered step and the compiled exact paged attention per layer (µs), their ratio, and
    the resident bytes per token of each; and the summarising cost per block.  ``model``: a
    workbench model for its shapes (None: the bundled model)."""
    from workbench_kernels.paged_decode import attention_decode_torch

    if model is None:
        from workbench.model.loader import load_model

        model = load_model(None, device="cpu")
    cfg = model.config
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator().manual_seed(0)
    exact_fn = torch.compile(attention_decode_torch, dynamic=False)
    tiered_fn = torch.compile(pooled_tiered_attention, dynamic=False)
    kb = budget // block_size
    rows = []
    for S in contexts:
        nb = S // block_size
        hot_b = max(1, window // block_size) + 1                        # the window and the sink block
        if nb <= hot_b + kb:
            continue
        for B in batches:
            n = B * nb + 1
            kc, vc = (torch.randn(n, block_size, nkv, hd, generator=gen) for _ in range(2))
            q = torch.randn(B, nh, hd, generator=gen)
            tables = torch.arange(B * nb, dtype=torch.int32).view(B, nb)
            lens = torch.full((B,), S, dtype=torch.int32)
            coef = torch.randn(n, block_size, nkv, rank, generator=gen)
            v8, vs, _ = int8_values(vc)
            mean, U = torch.zeros(nkv, hd), torch.linalg.qr(torch.randn(nkv, hd, rank, generator=gen)).Q
            hot = torch.cat([tables[:, :1], tables[:, nb - hot_b + 1:]], dim=1)
            warm = tables[:, 1:nb - hot_b + 1]
            exact = _time(lambda: exact_fn(q, kc, vc, tables, lens), repeats)
            tiered = _time(lambda: tiered_fn(q, kc, vc, hot, warm, coef, v8, vs, mean, U, kc, vc, kb), repeats)
            full = 2 * nkv * hd * 4                                     # fp32 K and V per token
            warm_bytes = nkv * (rank * 4 + hd + 2)                      # coefficients, int8 values, fp16 scale
            resident = (hot_b * block_size * full + (S - hot_b * block_size) * warm_bytes) / S
            rows.append({"context": S, "batch": B, "exact_us": exact, "tiered_us": tiered,
                         "tiered_vs_exact": tiered / exact, "exact_bytes_per_token": full,
                         "tiered_resident_bytes_per_token": resident,
                         "routed_bytes_per_step_per_row": kb * block_size * full})
    return {"device": str(model.device), "threads": torch.get_num_threads(),
            "shape": {"heads": nh, "kv_heads": nkv, "head_dim": hd, "layers": cfg.num_hidden_layers},
            "settings": {"window": window, "rank": rank, "budget": budget, "block_size": block_size},
            "summarize_us_per_block": summarize_block_us(model, rank, block_size), "rows": rows}
