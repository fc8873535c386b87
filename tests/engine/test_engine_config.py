"""EngineConfig: one configuration, the keywords as a front over it, every refusal in one place."""

from __future__ import annotations

import inspect

import pytest

from workbench.engine.config import (EngineConfig, FastPathConfig, LoadOptions, QuantConfig, TierSetup,
                                     reference_scheduler)
from workbench.errors import ConfigError
from workbench.kv.paged import PagedKVConfig
from workbench.sched.config import SchedulerConfig


def test_keywords_land_in_their_parts():
    kv, sched = PagedKVConfig(block_size=8), SchedulerConfig(max_num_seqs=4)
    cfg = EngineConfig.from_options(kv=kv, scheduler=sched, compile=True, quant="w8a8", quant_backend="reference",
                                    max_model_len=256, threads=1, memory_budget="1G")
    assert cfg.kv is kv and cfg.scheduler is sched and cfg.memory_budget == "1G"
    assert cfg.fast == FastPathConfig(compile=True) and cfg.fast.static
    assert cfg.quant == QuantConfig(recipe="w8a8", backend="reference")
    assert cfg.load == LoadOptions(max_model_len=256, threads=1)
    assert cfg.kv_mode == "paged" and cfg.paged is kv


def test_the_defaults_of_each_front():
    ref = EngineConfig.from_options()
    assert ref == EngineConfig() and ref.kv == "contiguous" and ref.scheduler is None and ref.kv_mode == "contiguous"
    assert ref.scheduler_for(512) == reference_scheduler(512)
    served = EngineConfig.from_options(serving_defaults=True)
    assert served.kv == PagedKVConfig() and served.scheduler == SchedulerConfig()
    assert EngineConfig.from_options(kv=None).kv == "contiguous"                  # LLM(kv=None): the reference
    assert EngineConfig.from_options(kv=None, serving_defaults=True).kv == PagedKVConfig()   # LLMEngine(kv=None)


def test_options_over_a_config_leave_the_config_alone():
    base = EngineConfig(kv=PagedKVConfig(block_size=8))
    cfg = EngineConfig.from_options(base, compile=True, threads=2)
    assert cfg.fast.compile and cfg.load.threads == 2 and cfg.kv is base.kv
    assert not base.fast.compile and base.load.threads is None


def test_tiers_keywords_build_one_part():
    cfg = EngineConfig.from_options(tiers="policy", tier_basis="basis", serving_defaults=True)
    assert cfg.tiers == TierSetup("policy", "basis", None) and cfg.kv is None and cfg.kv_mode == "tiered"
    with pytest.raises(ConfigError, match="tier_store= is where a tiered cache keeps its blocks; give tiers= too"):
        EngineConfig.from_options(tier_store="store")


def test_an_unknown_keyword_is_named_with_the_known_ones():
    with pytest.raises(ConfigError, match=r"LLM: unknown argument kv_config; known: model, config, tokenizer"):
        EngineConfig.from_options(kv_config=PagedKVConfig())


@pytest.mark.parametrize("cfg, match", [
    (EngineConfig(kv=PagedKVConfig(), tiers=TierSetup("p")), "give kv= \\(the paged pool\\) or tiers="),
    (EngineConfig(kv="pool"), "kv must be a PagedKVConfig, 'contiguous' or None, got 'pool'"),
    (EngineConfig(kv=3), "kv must be a PagedKVConfig, 'contiguous' or None, got int"),
    (EngineConfig(scheduler=SchedulerConfig(preemption_mode="swap")), "preemption_mode='swap' needs the paged pool"),
    (EngineConfig(fast=FastPathConfig(compile=True), tiers=TierSetup("p")), "compile / cuda_graphs run decode"),
    (EngineConfig(fast=FastPathConfig(static_decode=True, batch_invariant=True)), "batch_invariant=True is a"),
])
def test_every_refusal_is_decided_by_check(cfg, match):
    with pytest.raises(ConfigError, match=match):
        cfg.check("LLMEngine")


def test_refusals_that_need_a_fact_of_the_call():
    import torch

    graphs = EngineConfig(kv=PagedKVConfig(), fast=FastPathConfig(cuda_graphs=True))
    graphs.check("LLM")                                        # the device is not known before the load
    with pytest.raises(ConfigError, match="cuda_graphs=True needs a CUDA device; the model is on cpu"):
        graphs.check("LLMEngine", device=torch.device("cpu"))
    with pytest.raises(ConfigError, match="a custom runner needs the paged pool"):
        EngineConfig().check(runner=object())
    with pytest.raises(ConfigError, match="threads=2 cannot be applied to a model that is already loaded"):
        EngineConfig(load=LoadOptions(threads=2)).check(loaded=True)
    EngineConfig(load=LoadOptions(threads=2)).check(loaded=False)


def test_the_fronts_take_few_parameters():
    from workbench.engine.core import LLMEngine
    from workbench.engine.llm import LLM

    for cls in (LLM, LLMEngine):
        params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        assert len(params) <= 6, (cls.__name__, params)


def test_a_config_and_its_keywords_build_the_same_engine():
    from workbench.engine.llm import LLM

    by_keywords = LLM(kv=PagedKVConfig(block_size=8, num_blocks=64), max_model_len=128)
    cfg = EngineConfig(kv=PagedKVConfig(block_size=8, num_blocks=64), load=LoadOptions(max_model_len=128))
    by_config = LLM(None, cfg)
    assert by_config.engine.describe() == by_keywords.engine.describe() == "paged bs=8 blocks=64 prefix-cache seqs=1"
    assert by_config.max_model_len == 128 and by_config.engine.config.kv_mode == "paged"
    with pytest.raises(ConfigError, match="LLM: unknown argument num_blocks"):
        LLM(num_blocks=64)


def test_refusals_the_review_found_silent():
    from workbench.engine.core import LLMEngine
    from workbench.engine.llm import LLM
    from workbench.model.loader import load_model

    llm = LLM()
    with pytest.raises(ConfigError, match=r"LLMEngine: quant='w8a8' quantizes weights as a model is loaded; give it "
                                          r"to LLM\(\.\.\.\)"):
        LLMEngine(llm, quant="w8a8")
    model = load_model(None)
    with pytest.raises(ConfigError, match=r"LLM: dtype='float16' for a model object in torch.float32; convert it"):
        LLM(model, dtype="float16")
    with pytest.raises(ConfigError, match=r"LLM: stream_weights must be a WeightStreamConfig, got str"):
        LLM(stream_weights="x")
    with pytest.raises(ConfigError, match=r"LLM: cuda_graphs=True needs a CUDA device; the model is on cpu"):
        LLM(device="cpu", cuda_graphs=True)                       # before the load, named by the front used
    with pytest.raises(ConfigError, match=r"cannot be applied to a model that is already loaded \(an LLM or "):
        LLMEngine(llm.loaded, threads=1)
    assert LLM(model, dtype="float32", device="cpu").model is model     # its own device and dtype: accepted
