"""Tiered KV cache (hot / warm / cold + routing), PCA bases, byte accounting, sweep.

Exactness tests compare against the reference model's plain forward (no cache).  Tolerances:
the tiered path computes attention as an explicit fp32 softmax instead of SDPA, and a rank-hd
PCA reconstruction is exact only up to fp32 rounding of ``mean + U U^T (k - mean)``, so logits
agree to ~1e-6; we allow 1e-5 (exact zones) and 1e-4 (reconstruction / step-by-step paths).
"""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from workbench.model.config import ModelConfig
from workbench.errors import ConfigError
from workbench.kv.pca import PCABasis, collect_keys, fit_pca_basis, fit_pca_from_model, unrotate
from workbench.kv.tier_config import TierConfig, resident_bytes, zone_counts, zone_masks
from workbench.bench.tier_eval import best_under, evaluate_config, grid_configs, pareto_front, sweep
from workbench.kv.tiers import TieredKVCache, is_tiered, tiered_attention
from workbench.model.kv_cache import KVCache
from workbench.model.decoder import Attention, CausalLM, RotaryEmbedding, apply_rope, init_weights

torch.set_num_threads(1)

N = 64  # tokens per test sequence


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    # std 0.2: sharper attention than the default init, so approximations visibly change logits.
    return init_weights(CausalLM(cfg), seed=5, std=0.2).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 96, (1, N), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def bases(model):
    calib = [torch.randint(0, 96, (48,), generator=torch.Generator().manual_seed(s)).tolist() for s in (7, 8)]
    return {ks: fit_pca_from_model(model, calib, key_space=ks) for ks in ("post_rope", "pre_rope")}


@pytest.fixture(scope="module")
def reference(model, ids):
    with torch.no_grad():
        return model(ids)


def run_tiered(model, cfg, basis, ids, segment=None):
    cache = TieredKVCache(model.config, cfg, basis, max_len=ids.shape[1])
    with torch.no_grad(), tiered_attention(model):
        if segment is None:
            return model(ids, cache=cache), cache
        outs = [model(ids[:, s:s + segment], start_pos=s, cache=cache) for s in range(0, ids.shape[1], segment)]
    return torch.cat(outs, 1), cache


def max_diff(a, b):
    return float((a - b).abs().max())


# ---- exactness ---------------------------------------------------------------------------

def test_all_hot_equals_full_cache(model, ids, reference, bases):
    out, cache = run_tiered(model, TierConfig(window=N, rank=2, warm_tokens=8, chunk=4, block=8, budget=8),
                            bases["post_rope"], ids, segment=24)
    assert cache.zone_counts().hot == N
    assert max_diff(out, reference) < 1e-5


@pytest.mark.parametrize("key_space", ["post_rope", "pre_rope"])
def test_full_rank_warm_equals_full_precision(model, ids, reference, bases, key_space):
    cfg = TierConfig(window=4, sink=2, rank=model.config.head_dim, key_space=key_space)
    out, cache = run_tiered(model, cfg, bases[key_space], ids)
    assert cache.zone_counts().warm == N - 6
    assert max_diff(out, reference) < 1e-4


def test_low_rank_warm_is_not_exact(model, ids, reference, bases):
    out, _ = run_tiered(model, TierConfig(window=4, sink=2, rank=1), bases["post_rope"], ids)
    assert max_diff(out, reference) > 1e-3      # the approximation is really applied


def test_cold_chunk_of_one_is_exact(model, ids, reference):
    cfg = TierConfig(window=4, sink=2, warm_tokens=0, chunk=1, block=4)   # no warm zone: no basis needed
    out, cache = run_tiered(model, cfg, None, ids)
    assert cache.zone_counts().cold_chunks == N - 6
    assert max_diff(out, reference) < 1e-5


def test_dropping_cold_tokens_is_not_exact(model, ids, reference):
    cfg = TierConfig(window=4, sink=2, warm_tokens=0, chunk=1, cold_mode="drop")
    out, _ = run_tiered(model, cfg, None, ids)
    assert max_diff(out, reference) > 1e-3


def test_cold_summary_is_exact_for_equal_keys_in_a_chunk():
    """The log(count) term: C equal keys with different values == one pseudo-token."""
    cfg_m = ModelConfig(vocab_size=8, hidden_size=16, intermediate_size=16, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    cfg = TierConfig(window=2, sink=0, warm_tokens=0, chunk=4, block=4)
    g = torch.Generator().manual_seed(0)
    S, hd = 18, 16   # chunks [0,4) .. [12,16) cold for the last query; 16, 17 hot
    k = torch.randn(1, 1, S // 4 + 1, hd, generator=g).repeat_interleave(4, dim=2)[:, :, :S]
    v = torch.randn(1, 1, S, hd, generator=g)
    q = torch.randn(1, 2, 1, hd, generator=g)
    basis = fit_pca_basis([torch.randn(1, 32, hd, generator=g)])   # required (a partial chunk may be warm)
    cache = TieredKVCache(cfg_m, cfg, basis)
    cache.update(0, k[:, :, :S - 1], v[:, :, :S - 1], 0)
    cache.update(0, k[:, :, S - 1:], v[:, :, S - 1:], S - 1)
    out = cache.attend_tiered(0, q, S - 1)
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert cache.zone_counts(S).cold_chunks == 4
    assert max_diff(out, exact) < 1e-5


def test_budget_covering_all_blocks_is_exact(model, ids, reference, bases):
    cfg = TierConfig(window=4, sink=2, rank=1, warm_tokens=8, chunk=4, block=8, budget=N, value_format="int8")
    out, cache = run_tiered(model, cfg, bases["post_rope"], ids)
    z = cache.zone_counts()
    assert z.warm > 0 and z.cold_chunks > 0
    assert max_diff(out, reference) < 1e-5


def test_one_pass_equals_step_by_step_decoding(model, ids, bases):
    """Evaluating a document in one call gives each query the view token-by-token decoding has."""
    cfg = TierConfig(window=6, sink=1, rank=3, warm_tokens=12, chunk=4, block=8, budget=16,
                     value_format="int8", key_space="pre_rope")
    one_pass, c1 = run_tiered(model, cfg, bases["pre_rope"], ids)
    cache = TieredKVCache(model.config, cfg, bases["pre_rope"], max_len=N)
    with torch.no_grad(), tiered_attention(model):
        steps = [model(ids[:, :10], cache=cache)]
        steps += [model(ids[:, i:i + 1], start_pos=i, cache=cache) for i in range(10, N)]
    assert max_diff(torch.cat(steps, 1), one_pass) < 1e-4
    assert torch.allclose(c1.fetched_bytes_by_pos, cache.fetched_bytes_by_pos)
    assert c1.fetched_bytes_by_pos.sum() > 0


def test_context_manager_restores_reference_attention(model, ids, reference):
    with torch.no_grad(), tiered_attention(model):
        assert is_tiered(model)
        kv = KVCache(model.config, 1, N)
        assert max_diff(model(ids, cache=kv), reference) < 1e-5    # other caches: reference path
    assert not is_tiered(model) and all(type(layer.self_attn) is Attention for layer in model.model.layers)
    # Without the transformation the tiered cache is the exact path.
    with torch.no_grad():
        cache = TieredKVCache(model.config, TierConfig(window=2, warm_tokens=0, chunk=1), None, max_len=N)
        assert max_diff(model(ids, cache=cache), reference) < 1e-5


# ---- zones and bytes -----------------------------------------------------------------------

def test_byte_accounting_by_hand():
    L, nkv, hd, S = 2, 2, 16, 40
    cfg = TierConfig(window=8, sink=2, rank=4, warm_tokens=8, chunk=4, block=8, element_bytes=2)
    z = zone_counts(S, cfg)
    # hot: 2 sinks + 8 recent; cold: chunks end <= 40-8-8 = 24 -> [2,6)..[18,22): 5 chunks; warm: the rest
    assert (z.hot, z.cold_chunks, z.cold_tokens, z.warm) == (10, 5, 20, 10)
    per_head = 10 * (2 * 16 * 2) + 10 * (4 * 2 + 16 * 2) + 5 * (2 * 16 * 2)   # 640 + 400 + 320
    basis = L * nkv * (16 + 16 * 4) * 2                                     # 640
    assert resident_bytes(S, cfg, L, nkv, hd) == L * nkv * per_head + basis == 6080
    int8 = cfg.replace(value_format="int8")                                 # V: 16 int8 + fp16 scale
    assert resident_bytes(S, int8, L, nkv, hd) == L * nkv * (640 + 10 * (8 + 16 + 2) + 320) + basis
    drop = cfg.replace(cold_mode="drop")
    assert resident_bytes(S, drop, L, nkv, hd) == L * nkv * (640 + 400) + basis
    # the masks attention uses agree with the counts
    m = zone_masks(S - 1, 1, cfg)
    assert (int(m.hot.sum()), int(m.warm.sum()), int(m.cold.sum()), int(m.chunk_cold.sum())) == (10, 10, 20, 5)


def test_fetched_bytes_by_hand(bases):
    cfg_m = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    model = init_weights(CausalLM(cfg_m), seed=5).eval()
    cfg = TierConfig(window=8, sink=2, rank=4, warm_tokens=8, chunk=4, block=8, budget=64)
    cache = TieredKVCache(cfg_m, cfg, bases["post_rope"], max_len=40)
    ids = torch.randint(0, 96, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), tiered_attention(model):
        model(ids, cache=cache)
    # head_dim 8.  budget >= all non-hot tokens: the last step fetches every warm K (8 * 2 bytes)
    # and every cold K + V (2 * 8 * 2 bytes), in each of 2 layers x 2 KV heads
    assert cache.fetched_bytes_by_pos[39] == 2 * 2 * (10 * 16 + 20 * 32)
    # hot 10 * 32 + warm 10 * (4 * 2 + 8 * 2) + cold 5 * 32 per layer and head, + basis 4 * (8 + 32) * 2
    assert cache.resident_bytes() == 4 * (320 + 240 + 160) + 320
    assert cache.full_resident_bytes() == 40 * 2 * 2 * 2 * 8 * 2


# ---- PCA ----------------------------------------------------------------------------------

def test_pca_recovers_synthetic_low_rank(tmp_path):
    g = torch.Generator().manual_seed(0)
    nkv, n, hd, true_rank = 2, 500, 16, 3
    keys = []
    for _ in range(2):
        w = torch.randn(nkv, true_rank, hd, generator=g)
        z = torch.randn(nkv, n, true_rank, generator=g)
        keys.append(z @ w + torch.randn(nkv, 1, hd, generator=g) + 1e-4 * torch.randn(nkv, n, hd, generator=g))
    basis = fit_pca_basis(keys, source="synthetic")
    assert float(basis.explained(true_rank).min()) > 0.9999
    assert float(basis.explained(true_rank - 1).max()) < 0.99
    table = basis.explained_variance_table()
    assert list(table.columns) == ["layer", "kv_head", "rank", "explained"] and len(table) == 2 * nkv * hd
    assert table.groupby(["layer", "kv_head"])["explained"].apply(lambda s: s.is_monotonic_increasing).all()
    loaded = PCABasis.load(basis.save(tmp_path / "basis.safetensors"))
    assert torch.equal(loaded.components, basis.components) and loaded.source == "synthetic"


def test_collect_keys_shapes_and_pre_rope_inverse(model):
    keys = collect_keys(model, [[1, 2, 3, 4, 5], [6, 7, 8]])
    assert len(keys) == 2 and keys[0].shape == (2, 8, model.config.head_dim)
    rope = RotaryEmbedding(model.config)
    cos, sin = rope(0, 5, torch.device("cpu"), torch.float32)
    x = torch.randn(1, 2, 5, model.config.head_dim)
    assert max_diff(unrotate(apply_rope(x, cos, sin), cos, sin), x) < 1e-5


# ---- validation -----------------------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("window", 0), ("sink", -1), ("rank", 0), ("warm_tokens", -4),
                                          ("chunk", 0), ("block", 1.5), ("budget", -16), ("element_bytes", 0),
                                          ("value_format", "int4"), ("key_space", "rope"), ("cold_mode", "max"),
                                          ("window", True)])
def test_tier_config_errors_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"'{field}'"):
        TierConfig(**{field: value})


def test_tier_config_relations():
    with pytest.raises(ConfigError, match="'block'"):
        TierConfig(warm_tokens=16, chunk=16, block=8)
    with pytest.raises(ConfigError, match="'budget'"):
        TierConfig(block=16, budget=24)
    TierConfig(warm_tokens=None, chunk=16, block=8)          # no cold zone: block free


def test_cache_checks_basis(model, bases):
    with pytest.raises(ConfigError, match="'basis'"):
        TieredKVCache(model.config, TierConfig(window=4), None)
    with pytest.raises(ConfigError, match="'rank'"):
        TieredKVCache(model.config, TierConfig(rank=model.config.head_dim + 1), bases["post_rope"])
    with pytest.raises(ConfigError, match="'key_space'"):
        TieredKVCache(model.config, TierConfig(key_space="pre_rope"), bases["post_rope"])


# ---- evaluation and sweep -------------------------------------------------------------------

def test_evaluate_config_full_window_matches_reference(model, ids, bases):
    r = evaluate_config(model, TierConfig(window=N), bases["post_rope"], [ids[0].tolist()], eval_tokens=16)
    assert r["kl"] == pytest.approx(0, abs=1e-6) and r["top1"] == 1 and abs(r["rel_ppl"]) < 1e-5
    assert r["reduction"] == pytest.approx(1.0) and r["scored_tokens"] == 16


def test_sweep_records_failures_and_continues(model, ids, bases):
    seqs = [ids[0, :40].tolist(), ids[0, 24:].tolist()]
    configs = grid_configs(TierConfig(sink=2, rank=2, chunk=4, block=4), window=[4, 8], warm_tokens=[8])
    configs.insert(1, dict(configs[0], block=6))                          # invalid: block % chunk
    configs.append(dict(configs[0], rank=model.config.head_dim + 1))      # rank above the basis
    df = sweep(model, bases, seqs, configs, eval_tokens=16)
    assert len(df) == 4
    assert df["error"].notna().tolist() == [False, True, False, True]
    assert "'block'" in df.loc[1, "error"] and "'rank'" in df.loc[3, "error"]
    ok = df[df["error"].isna()]
    assert (ok["reduction"] > 1).all() and ok["ppl"].notna().all() and (ok["kl"] > 0).all()
    assert math.isfinite(float(ok["rel_ppl"].iloc[0]))


def test_pareto_front_and_best():
    df = pd.DataFrame({"name": list("abcde"), "reduction": [1.0, 2.0, 3.0, 2.5, 4.0],
                       "rel_ppl": [0.0, 0.01, 0.015, 0.02, 0.10], "error": [None, None, None, None, "x"]})
    assert pareto_front(df)["name"].tolist() == ["a", "b", "c"]
    assert best_under(df, 0.02)["name"].iloc[0] == "c"


def test_engine_runs_tiered_requests_and_exposes_their_caches(random_llm):
    """LLM(tiers=...) decodes with the tiered cache; a config that keeps everything hot gives
    the reference tokens, and the finished request's cache is kept for inspection."""
    import workbench
    from workbench import SamplingParams
    from workbench.kv import TierConfig, TieredKVCache

    p = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = list(range(5, 40))
    ref = random_llm.generate([prompt], p)[0].token_ids
    model = workbench.model.decoder.CausalLM(random_llm.model.config)
    model.load_state_dict(random_llm.model.state_dict())
    all_hot = workbench.LLM(model.eval(), tokenizer=random_llm.tokenizer,
                            tiers=TierConfig(window=256, warm_tokens=0, chunk=1))
    out = all_hot.generate([prompt], p)[0]
    assert out.token_ids == ref
    assert isinstance(all_hot.last_cache, TieredKVCache) and all_hot.last_cache.length == len(prompt) + 9
    assert not all_hot.active_caches
    z = all_hot.last_cache.zone_counts()
    assert z.hot == len(prompt) + 9
    with pytest.raises(workbench.WorkbenchError, match="not both"):
        workbench.LLM(model, tiers=TierConfig(), kv=workbench.kv.PagedKVConfig())
    with pytest.raises(workbench.WorkbenchError, match="basis"):
        workbench.LLM(model, tiers=TierConfig(window=8))


def test_zone_masks_say_on_the_host_whether_any_token_is_warm_or_cold():
    """attend_zones asks these flags instead of the masks (a device sync per layer on a GPU)."""
    import itertools

    from workbench.kv.tier_config import zone_masks

    for window, sink, wt, chunk in itertools.product((1, 5), (0, 3), (None, 0, 4), (1, 4)):
        cfg = TierConfig(window=window, rank=1, sink=sink, warm_tokens=wt, chunk=chunk, block=4)
        for start in range(0, 16):
            for T in (1, 3):
                m = zone_masks(start, T, cfg)
                assert m.any_warm == bool(m.warm.any()), (cfg, start, T)
                assert m.any_chunk_cold == bool(m.chunk_cold.any()), (cfg, start, T)
