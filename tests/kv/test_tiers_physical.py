"""The physical tiered cache against the accounted one: bit-identical logits, measured bytes
equal to the formula, routed blocks through the prefetcher, the engine and the server."""

from __future__ import annotations

import httpx
import pytest
import torch

from workbench.errors import ConfigError
from workbench.kv.pca import fit_pca_from_model
from workbench.kv.tier_config import TierConfig, zone_bytes
from workbench.kv.tiers import TieredKVCache, tiered_attention
from workbench.kv.tiers_physical import PhysicalTieredKVCache, TierStore
from workbench.measure.memory import storage_bytes
from workbench.model.config import ModelConfig
from workbench.model.decoder import CausalLM, init_weights

torch.set_num_threads(1)
N = 96

CONFIGS = [
    TierConfig(window=16, rank=4, warm_tokens=16, chunk=8, block=8, budget=16, key_space="pre_rope"),
    TierConfig(window=16, rank=4, warm_tokens=16, chunk=8, block=8, budget=16, value_format="int8"),
    TierConfig(window=16, rank=4, warm_tokens=None, block=8, budget=16),                   # warm only
    TierConfig(window=16, rank=4, warm_tokens=16, chunk=8, block=8, budget=None),          # no routing
    TierConfig(window=16, rank=4, warm_tokens=0, chunk=8, block=8, budget=16),             # cold only
    TierConfig(window=16, rank=4, warm_tokens=16, chunk=8, block=8, budget=8, cold_mode="drop"),
]


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return init_weights(CausalLM(cfg), seed=5, std=0.2).eval()


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 96, (1, N), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def bases(model):
    calib = [torch.randint(0, 96, (48,), generator=torch.Generator().manual_seed(s)).tolist() for s in (7, 8)]
    return {ks: fit_pca_from_model(model, calib, key_space=ks) for ks in ("post_rope", "pre_rope")}


def run(model, cache, ids, segments):
    outs, s = [], 0
    with torch.no_grad(), tiered_attention(model):
        for T in segments:
            outs.append(model(ids[:, s:s + T], start_pos=s, cache=cache))
            s += T
    return torch.cat(outs, 1)


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.name)
@pytest.mark.parametrize("segments", [[40] + [1] * 56, [32, 32, 32]], ids=["prefill+decode", "chunks"])
def test_bit_identical_to_accounted_and_bytes_equal_formula(model, ids, bases, cfg, segments):
    basis = bases[cfg.key_space]
    acc = run(model, TieredKVCache(model.config, cfg, basis, max_len=N), ids, segments)
    cache = PhysicalTieredKVCache(model.config, cfg, basis, store=TierStore(predict="both"), max_len=N)
    phy = run(model, cache, ids, segments)
    assert torch.equal(acc, phy)
    mem = cache.memory()
    c = model.config
    want = zone_bytes(N, cfg.replace(element_bytes=4), c.num_hidden_layers, c.num_key_value_heads, c.head_dim,
                      basis_element_bytes=4)
    assert {z: mem["measured"][z] for z in want} == want          # exact-size tensors, nothing else kept
    assert mem["resident_kv"] == mem["formula_kv"] < mem["full"]
    if cfg.budget and cfg.warm_tokens != 0:
        assert cache.routed_bytes > 0 and cache.prefetcher.stats()["bytes"] > 0
    cache.release()
    assert cache.prefetcher.transport.bytes_stored == 0 and cache._keys == set()


def test_predictors_count_what_they_do(model, ids, bases):
    cfg = CONFIGS[0]
    st = {}
    for predict in ("none", "step", "layer", "both"):
        cache = PhysicalTieredKVCache(model.config, cfg, bases["pre_rope"], store=TierStore(predict=predict), max_len=N)
        run(model, cache, ids, [40])
        cache.prefetcher.reset_stats()
        run_from = 40
        with torch.no_grad(), tiered_attention(model):
            for p in range(run_from, N):
                model(ids[:, p:p + 1], start_pos=p, cache=cache)
        st[predict] = cache.prefetcher.stats()
        staged = cache.memory()["measured"]["staging"]
        if predict == "none":
            assert staged == 0
        cache.release()
    assert st["none"]["hits"] == 0 and st["none"]["demand"] == st["none"]["uses"] > 0
    assert st["step"]["reused"] > 0 and st["step"]["predicted"] == 0 and st["step"]["bytes"] < st["none"]["bytes"]
    assert st["layer"]["predicted"] > 0 and st["layer"]["reused"] == 0
    assert st["both"]["prefetch_hit_rate"] >= st["step"]["prefetch_hit_rate"]
    for s in st.values():      # every routed record was used once per need, whatever the predictor
        assert s["uses"] == st["none"]["uses"]


def test_disk_store_same_logits(model, ids, bases, tmp_path):
    cfg = CONFIGS[0]
    ref = run(model, TieredKVCache(model.config, cfg, bases["pre_rope"], max_len=N), ids, [40] + [1] * 56)
    cache = PhysicalTieredKVCache(model.config, cfg, bases["pre_rope"],
                                  store=TierStore(offload="disk", path=str(tmp_path / "kv.bin")), max_len=N)
    assert torch.equal(run(model, cache, ids, [40] + [1] * 56), ref)
    assert cache.prefetcher.stats()["transport"] == "disk" and cache.memory()["offloaded"] > 0
    cache.release()


def test_bad_setups_are_clear_errors(model, bases):
    mc = model.config
    with pytest.raises(ConfigError, match="'block'"):
        PhysicalTieredKVCache(mc, TierConfig(window=8, rank=4, block=16, budget=16), bases["post_rope"])
    with pytest.raises(ConfigError, match="batch_size"):
        PhysicalTieredKVCache(mc, TierConfig(window=16, rank=4), bases["post_rope"], batch_size=2)
    with pytest.raises(ConfigError, match="'predict'"):
        TierStore(predict="soon")
    with pytest.raises(ConfigError, match="'offload'"):
        TierStore(offload="tape")
    with pytest.raises(ConfigError, match="'basis'"):
        PhysicalTieredKVCache(mc, TierConfig(window=16, rank=4), None)
    cache = PhysicalTieredKVCache(mc, TierConfig(window=16, rank=4), bases["post_rope"], max_len=8)
    cache.release()
    with pytest.raises(RuntimeError, match="after release"):
        run(model, cache, torch.zeros(1, 4, dtype=torch.long), [4])


def test_storage_bytes_counts_each_storage_once():
    a = torch.zeros(10)
    assert storage_bytes([a, a[2:5], torch.zeros(3, dtype=torch.int8)]) == 40 + 3
    seen: set = set()
    assert storage_bytes([a], seen) == 40 and storage_bytes([a], seen) == 0


# ---- the engine and the server, on the bundled model -----------------------------------------

@pytest.fixture(scope="module")
def bundled_tiers(bundled_llm):
    from workbench.bench.tier_eval import heldout_split

    split = heldout_split(bundled_llm.tokenizer, 256)
    cfg = TierConfig(window=32, rank=8, warm_tokens=32, chunk=16, block=16, budget=32, key_space="pre_rope")
    basis = fit_pca_from_model(bundled_llm.model, split["calibration"][:1], key_space="pre_rope")
    return cfg, basis, [split["evaluation"][i][:120 + 30 * i] for i in range(3)]


def test_engine_batched_physical_matches_accounted(bundled_llm, bundled_tiers):
    import workbench as wb
    from workbench import SamplingParams
    from workbench.sched import SchedulerConfig

    cfg, basis, prompts = bundled_tiers
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    toks = {}
    for store in (None, TierStore()):
        llm = wb.LLM(bundled_llm.model, tokenizer=bundled_llm.tokenizer, tiers=cfg, tier_basis=basis,
                     tier_store=store, scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=256))
        eng = llm.engine
        rids = [eng.add_request(p, sp) for p in prompts]
        seen_memory = None
        while eng.has_unfinished():
            eng.step()
            mem = eng.stats()["kv_memory"]
            if mem and mem["sequences"] == 3 and seen_memory is None:
                seen_memory = mem
        toks[store is None] = [eng.release(r).token_ids for r in rids]
        if store is not None:
            assert seen_memory["resident_kv"] == seen_memory["formula_kv"] < seen_memory["full"]
            assert eng.stats()["prefetch"]["tiers"]["uses"] > 0
            assert "store=host predict=step" in eng.describe_kv()
            last = eng.last_cache       # kept for inspectors; the others released their records
            keys = eng.tier_prefetcher.transport._sizes
            assert keys and all(k[0] == last.uid for k in keys)
        else:
            assert eng.stats()["kv_memory"] is None
    assert toks[True] == toks[False]


def test_server_reports_tier_memory(bundled_llm, bundled_tiers):
    from workbench.engine import LLMEngine
    from workbench.serve import ServerConfig, start_server

    cfg, basis, _ = bundled_tiers
    eng = LLMEngine(bundled_llm, tiers=cfg, tier_basis=basis, tier_store=TierStore())
    with start_server(eng, ServerConfig(port=0)) as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as http:
            r = http.post("/v1/completions", json={"prompt": "The list type " * 20, "max_tokens": 4})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
            import json

            info = json.loads(r.headers["x-model-info"])
            assert info["kv_tiers"] == {"config": cfg.name, "store": "host", "predict": "step"}
            text = http.get("/metrics").text
    assert 'workbench_kv_resident_bytes{zone="hot"}' in text
    assert 'workbench_prefetch_uses_total{kind="tiers"}' in text


def test_chunk_may_exceed_window_without_cold_summaries(model, ids, bases):
    for cfg in (TierConfig(window=8, rank=4, block=8, budget=16),                         # no cold zone, chunk 16
                TierConfig(window=8, rank=4, warm_tokens=8, block=8, chunk=16, budget=16, cold_mode="drop")):
        cache = PhysicalTieredKVCache(model.config, cfg, bases["post_rope"], max_len=N)
        acc = run(model, TieredKVCache(model.config, cfg, bases["post_rope"], max_len=N), ids, [30] + [1] * 10)
        assert torch.equal(run(model, cache, ids, [30] + [1] * 10), acc)
        cache.release()


def test_inspectors_read_a_physical_engine(bundled_llm, bundled_tiers):
    import workbench as wb
    from workbench import SamplingParams
    from workbench.kv.inspect import report

    cfg, basis, prompts = bundled_tiers
    llm = wb.LLM(bundled_llm.model, tokenizer=bundled_llm.tokenizer, tiers=cfg, tier_basis=basis,
                 tier_store=TierStore(predict="both"))
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    rep = report(llm)
    last = rep["last"]
    assert last["bytes"]["measured"] and last["bytes"]["resident"] == llm.engine.last_cache.memory()["resident_kv"]
    assert last["zones"]["hot"] > 0 and len(last["zone_map"]) == bundled_llm.model.config.num_hidden_layers
    # the kept cache was finished: no staging, no copy still on its way; its records stay for inspection
    assert llm.engine.last_cache.memory()["measured"]["staging"] == 0 and not llm.engine.tier_prefetcher.pending
    assert llm.engine.last_cache.memory()["offloaded"] > 0


def test_serve_refuses_tier_store_without_tiers(capsys):
    from workbench.cli.main import main

    assert main(["serve", "--tier-store", "host", "--port", "0"]) == 2
    assert "--tiers" in capsys.readouterr().err


def test_summary_reads_on_a_cuda_transport_are_timed_with_events(model, ids, bases, monkeypatch):
    """A parked summary read on CUDA enqueues the copy and the compute stream's wait: its time
    (summary_read_s) comes from CUDA events (here, fakes), not from the host's enqueue time."""
    from fake_cuda import FakeCudaTransport, FakeEvent, install
    from workbench.prefetch.prefetcher import Prefetcher

    install(monkeypatch)
    monkeypatch.setattr(FakeEvent, "elapsed_time", lambda self, end: 2.0)
    cfg = CONFIGS[0]
    cache = PhysicalTieredKVCache(model.config, cfg, bases[cfg.key_space], max_len=N,
                                  prefetcher=Prefetcher(FakeCudaTransport()))
    phy = run(model, cache, ids, [40] + [1] * 56)
    assert torch.equal(phy, run(model, TieredKVCache(model.config, cfg, bases[cfg.key_space], max_len=N), ids,
                                [40] + [1] * 56))
    assert cache.summary_reads > 0
    assert cache.summary_read_s == pytest.approx(cache.summary_reads * 2e-3)
    cache.release()


@pytest.mark.parametrize("budget", [8, 32])
def test_a_decode_step_syncs_per_layer_not_per_routed_block(model, ids, bases, budget, monkeypatch):
    """Per layer and step: one device -> host copy for routing's bytes and one for the fetch
    decision, no scalar reads, nonzero or boolean indexing; the same with more routed blocks."""
    from fake_cuda import CountSyncs

    cfg = TierConfig(window=16, rank=4, warm_tokens=16, chunk=8, block=8, budget=budget)
    cache = PhysicalTieredKVCache(model.config, cfg, bases[cfg.key_space], store=TierStore(predict="both"), max_len=N)
    run(model, cache, ids, [N - 1])
    copies = []
    real = torch.Tensor.cpu
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *a, **k: copies.append(1) or real(self, *a, **k))
    with CountSyncs() as c, torch.no_grad(), tiered_attention(model):
        model(ids[:, N - 1:], start_pos=N - 1, cache=cache)
    assert c.n == 0, c.ops
    assert len(copies) == 2 * model.config.num_hidden_layers
    assert cache.routed_bytes > 0


def test_completed_blocks_are_offloaded_in_one_batch_per_layer(model, ids, bases, monkeypatch):
    from fake_cuda import FakeCudaTransport, install
    from workbench.prefetch.prefetcher import Prefetcher

    install(monkeypatch)
    tr = FakeCudaTransport()
    batches = []
    real = tr.put_many
    monkeypatch.setattr(tr, "put_many", lambda items: batches.append(len(items)) or real(items))
    cfg = CONFIGS[0]
    cache = PhysicalTieredKVCache(model.config, cfg, bases[cfg.key_space], max_len=N, prefetcher=Prefetcher(tr))
    run(model, cache, ids, [64])
    assert len(batches) == model.config.num_hidden_layers and min(batches) > 2
    assert len(cache._keys) == sum(batches)
    cache.release()
