"""The cost model of tiers on the paged pool (workbench.bench.tier_pool): its tiered step is the exact
paged attention when the budget routes every warm block, and the cost table has its columns."""

from __future__ import annotations

import torch

from workbench.bench.tier_pool import pooled_tiered_attention, tier_pool_cost


def test_routing_every_warm_block_is_exact_attention():
    from workbench_kernels.paged_decode import attention_decode_ref
    from workbench.kv.tier_attention import int8_values

    gen = torch.Generator().manual_seed(1)
    B, nh, nkv, hd, bs, nb, r = 2, 4, 2, 8, 4, 6, 3
    kc, vc = (torch.randn(B * nb, bs, nkv, hd, generator=gen) for _ in range(2))
    q = torch.randn(B, nh, hd, generator=gen)
    tables = torch.arange(B * nb, dtype=torch.int32).view(B, nb)
    coef = torch.randn(B * nb, bs, nkv, r, generator=gen)
    v8, vs, _ = int8_values(vc)
    mean, U = torch.zeros(nkv, hd), torch.linalg.qr(torch.randn(nkv, hd, r, generator=gen)).Q
    hot, warm = tables[:, :2], tables[:, 2:]
    want = attention_decode_ref(q, kc, vc, tables, torch.full((B,), nb * bs, dtype=torch.int32))
    got = pooled_tiered_attention(q, kc, vc, hot, warm, coef, v8, vs, mean, U, kc, vc, budget_blocks=nb - 2)
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    approx = pooled_tiered_attention(q, kc, vc, hot, warm, coef, v8, vs, mean, U, kc, vc, budget_blocks=1)
    assert not torch.allclose(approx, want, atol=1e-3)        # random summaries: the unrouted blocks differ


def test_cost_table(random_llm):
    res = tier_pool_cost(random_llm.model, contexts=(128,), batches=(1, 2), window=16, rank=4, budget=32,
                         block_size=16, repeats=2)
    assert [(r["context"], r["batch"]) for r in res["rows"]] == [(128, 1), (128, 2)]
    for r in res["rows"]:
        assert r["exact_us"] > 0 and r["tiered_us"] > 0 and r["tiered_vs_exact"] > 0
        assert r["tiered_resident_bytes_per_token"] < r["exact_bytes_per_token"]
    assert res["summarize_us_per_block"] > 0
