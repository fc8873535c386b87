"""Sizes checked before allocation: the engine's pool, caches and buffers computed from its
configuration and refused in one line (figure, how it is reached, the flag) when they do not fit
the machine or a memory budget; ``max_model_len`` above the model's context refused, not clamped;
thread counts held to the cores (:mod:`workbench.measure.allocation`, :mod:`workbench.engine.sizing`).

Nothing here allocates much: a refusal is arithmetic, and the machine's available memory is
replaced by a small fake one where a test needs it."""

from __future__ import annotations

import time

import pytest
import torch

import workbench
from workbench.engine.sizing import check_before_loading, context_length, engine_memory_plan
from workbench.errors import ConfigError
from workbench.kv.paged import PagedKVConfig, PagedKVPool
from workbench.kv.tier_config import TierConfig
from workbench.measure import allocation as A
from workbench.measure import threads as T
from workbench.model.loader import model_config
from workbench.model.presets import preset_config
from workbench.sched.config import SchedulerConfig

GIB = 1 << 30


def fake_machine(monkeypatch, host: int, disk: int = 100 * GIB) -> None:
    """What every plan sees as available: ``host`` bytes of memory, ``disk`` bytes on any file system."""
    def look(place="cpu"):
        if str(place).startswith("disk:"):
            return A.Available(disk, "free on the test's file system")
        return A.Available(host, "available on the test machine")
    monkeypatch.setattr(A, "available_memory", look)


# ---- the library check ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, nbytes", [("8G", 8 * GIB), ("8GiB", 8 * GIB), ("8gb", 8 * GIB), ("512M", 512 << 20),
                                          ("1.5G", 3 * GIB // 2), ("64k", 64 << 10), ("8e9", 8 * 10**9),
                                          (" 1000 ", 1000), (4096, 4096)])
def test_parse_bytes_reads_sizes_with_suffixes(text, nbytes):
    assert A.parse_bytes(text) == nbytes
    assert A.parse_bytes(None) is None and A.parse_bytes("") is None


@pytest.mark.parametrize("bad", ["lots", "8X", "0", "-1G", "0.5", True, float("nan"), "1e30"])
def test_parse_bytes_refuses_what_is_not_a_size(bad):
    with pytest.raises(ConfigError, match="--memory-budget"):
        A.parse_bytes(bad, "memory_budget (--memory-budget)")


def test_format_bytes():
    assert A.format_bytes(2_000_000 * 98_304) == "183.1 GiB"
    assert A.format_bytes(98_304) == "96.0 KiB" and A.format_bytes(512) == "512 B"


def test_the_plan_refuses_the_first_item_past_the_machine_naming_figure_place_and_flag(monkeypatch):
    fake_machine(monkeypatch, host=10 * GIB)
    plan = A.MemoryPlan()
    plan.add("KV pool", 4 * GIB, "num_blocks / --num-blocks", "4 blocks x 1.0 GiB")
    plan.add("offload tier", 7 * GIB, "offload_blocks / --offload-blocks", "7 blocks x 1.0 GiB")
    with pytest.raises(ConfigError) as e:
        plan.check()
    msg = str(e.value)
    assert msg == ("offload tier: 7 blocks x 1.0 GiB = 7.0 GiB (with 4.0 GiB planned before it), more than the "
                   "10.0 GiB available on the test machine; set offload_blocks / --offload-blocks lower")


def test_a_budget_caps_the_sum_of_memory_and_leaves_files_out(monkeypatch):
    fake_machine(monkeypatch, host=100 * GIB, disk=100 * GIB)
    plan = A.MemoryPlan(budget=5 * GIB)
    plan.add("KV pool", 3 * GIB, "a")
    plan.add("offload tier (disk)", 50 * GIB, "b", place="disk:/tmp")     # a file: not memory
    plan.check()
    plan.add("static buffers", 3 * GIB, "c / --c")
    with pytest.raises(ConfigError, match=r"static buffers: 3\.0 GiB \(with 3\.0 GiB planned before it\), more than "
                                          r"the memory_budget / --memory-budget of 5\.0 GiB; set c / --c lower, or "
                                          r"raise memory_budget / --memory-budget"):
        plan.check()


def test_check_allocation_against_the_real_machine():
    A.check_allocation("a small buffer", 1 << 20, "x")               # 1 MiB: every machine has it
    with pytest.raises(ConfigError, match=r"more than the .* available on this host"):
        A.check_allocation("an absurd buffer", 1 << 60, "x")          # 1 EiB: none has
    host = A.available_memory("cpu")
    assert 0 < host.nbytes < 1 << 50 and ("host" in host.where or "container" in host.where)
    assert A.available_memory("disk:/tmp").nbytes > 0


# ---- the engine's plan: the figures are those of the allocations ------------------------------------------

def test_the_pool_plan_is_the_pool_the_engine_builds(random_llm):
    for static in (False, True):          # static decode adds the scratch block
        eng = workbench.LLMEngine(random_llm, kv=PagedKVConfig(block_size=8, num_blocks=37),
                                  static_decode=static, scheduler=SchedulerConfig(max_num_seqs=2))
        (pool,) = [i for i in eng.memory_plan.items if i.what == "KV pool"]
        assert pool.nbytes == eng.pool.nbytes() > 0
    default = workbench.LLMEngine(random_llm, scheduler=SchedulerConfig(max_num_seqs=4))   # 4 x 256 tokens
    assert default.memory_plan.items[0].nbytes == default.pool.nbytes()
    assert "max_num_seqs 4 x 256 tokens / block_size 16" in default.memory_plan.items[0].detail


def test_the_contiguous_plan_is_max_num_seqs_whole_contexts(random_llm):
    cfg = random_llm.model.config
    eng = workbench.LLMEngine(random_llm, kv="contiguous", scheduler=SchedulerConfig(max_num_seqs=3))
    (item,) = eng.memory_plan.items
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert item.what == "contiguous KV caches" and item.nbytes == 3 * 256 * per_token
    # what one request's cache really takes, times the sequences the scheduler admits
    one = random_llm.model.new_cache(1, 256)
    assert 3 * sum(t.numel() * t.element_size() for t in one.k + one.v) == item.nbytes


def test_an_8k_model_at_32_sequences_is_refused_with_its_figure(monkeypatch):
    """The finding: contiguous caches sized max_model_len x max_num_seqs (an 8K model at 32
    sequences) were allocated as traffic came and the OOM killer ended the server."""
    fake_machine(monkeypatch, host=22 * GIB)
    cfg = preset_config("llama-3-8b")
    with pytest.raises(ConfigError) as e:
        engine_memory_plan(cfg, "cpu", torch.bfloat16, kv="contiguous",
                           scheduler=SchedulerConfig(max_num_seqs=32)).check()
    assert str(e.value) == (
        "contiguous KV caches: max_num_seqs 32 x max_model_len 8,192 tokens x 128.0 KiB a token (32 layers x K,V x "
        "8 KV heads x 128 x 2 bytes) = 32.0 GiB, more than the 22.0 GiB available on the test machine; set "
        "SchedulerConfig.max_num_seqs / --max-num-seqs or max_model_len / --max-model-len lower")
    # the same engine at 4 sequences fits
    engine_memory_plan(cfg, "cpu", torch.bfloat16, kv="contiguous", scheduler=SchedulerConfig(max_num_seqs=4)).check()


def test_an_engine_that_does_not_fit_is_refused_before_it_allocates(random_llm, monkeypatch):
    fake_machine(monkeypatch, host=1 << 20)          # a 1 MiB machine
    made = []
    monkeypatch.setattr(PagedKVPool, "__init__", lambda *a, **k: made.append(a))
    with pytest.raises(ConfigError, match=r"^contiguous KV caches: max_num_seqs 32 x max_model_len 256 tokens"):
        workbench.LLMEngine(random_llm, kv="contiguous", scheduler=SchedulerConfig(max_num_seqs=32))
    with pytest.raises(ConfigError, match=r"^KV pool: "):
        workbench.LLMEngine(random_llm)
    assert made == []                                 # no pool (with or without tensors) was built


def test_num_blocks_past_any_machine_is_refused_fast(random_llm):
    """The finding: serve --num-blocks 2000000 reached 7 GB in 26 s, still growing; 1000000000 gave a
    raw allocator traceback.  Here against the real machine's memory: no machine has 7.6 TiB."""
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"^KV pool: 1,000,000,000 blocks \(num_blocks\) x 8\.0 KiB a block "
                                          r"\(16 tokens x 2 layers x K,V x 2 KV heads x 16 x 4 bytes\) = 7\.5 TiB, "
                                          r"more than the .* available .*; set PagedKVConfig\.num_blocks / "
                                          r"--num-blocks lower$"):
        workbench.LLMEngine(random_llm, kv=PagedKVConfig(num_blocks=10**9))
    assert time.perf_counter() - t0 < 2


def test_the_bundled_models_finding_figure(monkeypatch):
    fake_machine(monkeypatch, host=22 * GIB)
    with pytest.raises(ConfigError, match=r"KV pool: 2,000,000 blocks \(num_blocks\) x 96\.0 KiB a block .* = "
                                          r"183\.1 GiB, more than the 22\.0 GiB"):
        check_before_loading(None, "cpu", None, kv=PagedKVConfig(num_blocks=2_000_000))


def test_max_num_seqs_sizes_the_default_pool_and_is_named(monkeypatch):
    fake_machine(monkeypatch, host=22 * GIB)
    with pytest.raises(ConfigError, match=r"KV pool: 64,000,000 blocks \(max_num_seqs 1,000,000 x 1,024 tokens / "
                                          r"block_size 16\) .* set SchedulerConfig\.max_num_seqs / --max-num-seqs "
                                          r"lower, or give PagedKVConfig\.num_blocks / --num-blocks$"):
        check_before_loading(None, "cpu", None, kv=None, scheduler=SchedulerConfig(max_num_seqs=10**6))


def test_a_block_larger_than_the_context_is_a_range_error(random_llm):
    """The finding: --block-size 1000000 allocated one 6.5 GB block (it fit the machine)."""
    with pytest.raises(ConfigError, match=r"PagedKVConfig\.block_size=1,000,000 \(--block-size\) is more than the "
                                          r"model's context \(max_position_embeddings 256\).*give at most 256"):
        workbench.LLMEngine(random_llm, kv=PagedKVConfig(block_size=1_000_000))
    # a block longer than a short max_model_len is fine (decode-stack's 13-token contexts in blocks of 16)
    small = workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer, max_model_len=13,
                          kv=PagedKVConfig(block_size=16))
    assert small.engine.pool.block_size == 16


def test_offload_tiers_are_planned_in_host_memory_or_on_disk(monkeypatch):
    fake_machine(monkeypatch, host=1 * GIB, disk=2 * GIB)
    cfg = model_config(None)
    host = engine_memory_plan(cfg, "cpu", torch.float32, kv=PagedKVConfig(offload="host", offload_blocks=4096))
    assert [i.what for i in host.items] == ["KV pool", "KV offload tier (host)", "KV prefetch staging"]
    assert host.items[1].nbytes == 4096 * 98_304 and host.items[1].place == "cpu"
    host.check()                                   # 192 MiB + 384 MiB + 6 MiB < 1 GiB
    with pytest.raises(ConfigError, match=r"KV offload tier \(host\): 1,000,000 blocks x 96\.0 KiB = 91\.6 GiB .* set "
                                          r"PagedKVConfig\.offload_blocks / --offload-blocks lower"):
        engine_memory_plan(cfg, "cpu", torch.float32, kv=PagedKVConfig(offload="host", offload_blocks=10**6)).check()
    disk = engine_memory_plan(cfg, "cpu", torch.float32, memory_budget="300M",       # a file is not in a budget
                              kv=PagedKVConfig(offload="disk", offload_blocks=20_000, offload_path="/tmp/x.bin"))
    assert disk.items[1].place == "disk:/tmp"
    disk.check()                                   # 1.8 GiB on a 2 GiB file system; 198 MiB of memory
    with pytest.raises(ConfigError, match=r"KV offload tier \(disk\): 30,000 blocks x 96\.0 KiB = 2\.7 GiB, more than "
                                          r"the 2\.0 GiB free on the test's file system"):
        engine_memory_plan(cfg, "cpu", torch.float32, memory_budget="300M",
                           kv=PagedKVConfig(offload="disk", offload_blocks=30_000, offload_path="/tmp/x.bin")).check()


def test_static_decode_buffers_are_planned_at_max_model_len(random_llm, monkeypatch):
    cfg = random_llm.model.config
    plan = engine_memory_plan(cfg, "cpu", torch.float32, kv="contiguous", static_decode=True,
                              scheduler=SchedulerConfig(max_num_seqs=8))
    per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert plan.items[0].what == "static decode buffers" and plan.items[0].nbytes == 9 * 256 * per_token
    with pytest.raises(ConfigError, match=r"^static decode buffers: 9 rows \(max_num_seqs 8 \+ 1 scratch\) x "
                                          r"max_model_len 256 tokens"):
        workbench.LLMEngine(random_llm, kv="contiguous", static_decode=True, memory_budget="64k",
                            scheduler=SchedulerConfig(max_num_seqs=8))
    paged = engine_memory_plan(cfg, "cpu", torch.float32, kv=PagedKVConfig(), static_decode=True)
    assert [i.what for i in paged.items] == ["KV pool", "static decode inputs", "rotary tables"]


def test_the_accounted_tiered_cache_is_planned_with_its_copies(random_llm):
    cfg = random_llm.model.config
    tiers = TierConfig(window=32, rank=4, value_format="int8")
    plan = engine_memory_plan(cfg, "cpu", torch.float32, kv=None, tiers=tiers,
                              scheduler=SchedulerConfig(max_num_seqs=2))
    (item,) = plan.items
    contiguous = 2 * 256 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * 4
    assert item.what == "tiered KV caches" and item.nbytes > 2 * contiguous
    physical = engine_memory_plan(cfg, "cpu", torch.float32, kv=None, tiers=tiers, tier_store="host")
    assert physical.items == []                     # grows with its zones: nothing preallocated by the context


def test_llm_memory_budget_is_checked_before_the_weights_load(monkeypatch):
    from workbench.engine import loaded

    monkeypatch.setattr(loaded, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match="LLM\\(memory_budget=...\\): expected a size"):
        workbench.LLM(memory_budget="lots")
    with pytest.raises(ConfigError, match=r"^KV pool: .* more than the memory_budget / --memory-budget of 1\.0 MiB"):
        workbench.LLM(kv=PagedKVConfig(), scheduler=SchedulerConfig(max_num_seqs=8), memory_budget="1M")


def test_a_pool_built_directly_checks_its_tensors():
    cfg = preset_config("tiny")
    with pytest.raises(ConfigError, match=r"^KV pool: 1,000,000,000,000 blocks x .* more than"):
        PagedKVPool(cfg, PagedKVConfig(num_blocks=10**12), torch.device("cpu"), torch.float32, 0)
    with pytest.raises(ConfigError, match="memory_budget / --memory-budget of 1.0 KiB"):
        PagedKVPool(cfg, PagedKVConfig(num_blocks=64), torch.device("cpu"), torch.float32, 0, memory_budget=1024)


@pytest.mark.parametrize("field", ["num_blocks", "offload_blocks", "kv_cache_bytes"])
def test_counts_in_the_kv_config_are_integers(field):
    with pytest.raises(ConfigError, match=f"PagedKVConfig.{field} must be an integer >= 1, got 1000000000.0"):
        PagedKVConfig(**{field: 1e9})


# ---- max_model_len: refused above the context, never clamped ----------------------------------------------

def test_max_model_len_above_the_context_is_an_error_naming_both(random_llm):
    """The finding: --max-model-len 1e9 was silently clamped to 1,024 (LoadedModel took the min)."""
    with pytest.raises(ConfigError, match=r"max_model_len=1,000,000,000 \(--max-model-len\) is more than the model's "
                                          r"context: max_position_embeddings 256"):
        workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer, max_model_len=10**9)
    assert workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer, max_model_len=256).max_model_len == 256
    assert workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer, max_model_len=100).max_model_len == 100


@pytest.mark.parametrize("bad", [0, 1, -5, 1.5, "512", True])
def test_max_model_len_must_be_a_usable_integer(random_llm, bad):
    with pytest.raises(ConfigError, match="must be an integer >= 2"):
        context_length(random_llm.model.config, bad)


def test_max_model_len_of_a_folder_is_checked_from_its_config_before_loading(monkeypatch):
    from workbench.engine import loaded

    monkeypatch.setattr(loaded, "load_model", lambda *a, **k: pytest.fail("weights loaded before the check"))
    with pytest.raises(ConfigError, match="max_position_embeddings 1,024"):
        workbench.LLM(max_model_len=4096)


# ---- threads: at most the cores ---------------------------------------------------------------------------

def test_threads_above_the_cores_are_refused_before_torch_sees_them(random_llm, monkeypatch):
    """The finding: generate --threads 100000 segfaulted in libgomp (and the machine could not fork)."""
    before = torch.get_num_threads()
    cores = T.available_cores()
    assert T.usable_threads(cores) == cores and T.usable_threads("auto") is None
    with pytest.raises(ConfigError, match=rf"--threads: 100,000 threads is more than the {cores} core"):
        T.usable_threads("100000", where="--threads")
    with pytest.raises(ConfigError, match="more than the"):
        workbench.LLM(random_llm.model, tokenizer=random_llm.tokenizer, threads=100_000)
    monkeypatch.setenv(T.ENV, "100000")
    with pytest.raises(ConfigError, match="environment variable WORKBENCH_THREADS: 100,000 threads"):
        T.apply_thread_policy(random_llm.model)
    assert torch.get_num_threads() == before
