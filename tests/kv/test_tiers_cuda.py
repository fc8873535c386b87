"""The physical tiered cache on CUDA (run by scripts/device_check.sh): pinned host records copied
into HBM on the side stream, the same logits as the accounted cache, and its measured bytes
against ``torch.cuda.memory_allocated``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def setup():
    import workbench as wb
    from workbench.bench.tier_eval import heldout_split
    from workbench.kv.pca import fit_pca_from_model
    from workbench.kv.tier_config import TierConfig

    llm = wb.LLM(device="cuda")
    split = heldout_split(llm.tokenizer, 512)
    cfg = TierConfig(window=32, rank=8, warm_tokens=64, chunk=16, block=16, budget=64, key_space="pre_rope")
    basis = fit_pca_from_model(llm.model, split["calibration"][:1], key_space="pre_rope")
    return llm, cfg, basis, torch.tensor(split["evaluation"][0], device="cuda")[None]


def _run(model, cache, ids, segments):
    from workbench.kv.tiers import tiered_attention

    outs, s = [], 0
    with torch.no_grad(), tiered_attention(model):
        for T in segments:
            outs.append(model(ids[:, s:s + T], start_pos=s, cache=cache))
            s += T
    return torch.cat(outs, 1)


def test_cuda_physical_matches_accounted_and_memory_allocated(setup):
    from workbench.kv.tiers import TieredKVCache
    from workbench.kv.tiers_physical import PhysicalTieredKVCache, TierStore

    llm, cfg, basis, ids = setup
    model, N = llm.model, ids.shape[1]
    w = model.lm_head.weight
    segs = [N - 48] + [1] * 48
    acc = _run(model, TieredKVCache(model.config, cfg, basis, max_len=N, device="cuda", dtype=w.dtype), ids, segs)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    cache = PhysicalTieredKVCache(model.config, cfg, basis, store=TierStore(predict="both"), max_len=N,
                                  device="cuda", dtype=w.dtype)
    phy = _run(model, cache, ids, segs)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before - phy.numel() * phy.element_size()
    mem = cache.memory()
    st = cache.prefetcher.stats()
    print(f"\nCUDA physical tiers: measured resident {mem['resident_kv']} B + staging {mem['measured']['staging']} B, "
          f"formula {mem['formula_kv']} B, full {mem['full']} B, memory_allocated delta {held} B; "
          f"hit rate {st['prefetch_hit_rate']}, stall {st['stall_s']:.4f} s, bytes {st['bytes']}")
    assert torch.equal(acc, phy)
    assert mem["resident_kv"] == mem["formula_kv"] < mem["full"]
    measured = mem["resident_kv"] + mem["measured"]["staging"]
    assert measured <= held <= 1.5 * measured + (1 << 20)   # the caching allocator rounds blocks up (512 B)
    assert st["transport"] == "cuda" and st["uses"] > 0
    cache.release()
