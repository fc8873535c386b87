"""Weight streaming as an option of the one engine: same greedy tokens as all-resident in the
batched paged engine and on the compiled static path, quantized models too (their packed bytes
stream: tests/quant/test_quant_streaming.py has the recipes and backends), counters in stats() /
/metrics / x-model-info, and clear errors."""

from __future__ import annotations

import types

import pytest

from workbench.engine.core import LLMEngine
from workbench.engine.llm import LLM
from workbench.engine.sampling import SamplingParams
from workbench.errors import ConfigError
from workbench.kv.paged import PagedKVConfig
from workbench.prefetch.weights import WeightStreamConfig, weight_streamer
from workbench.sched.config import SchedulerConfig
from workbench.serve.health import model_info
from workbench.serve.metrics import ServerMetrics

PROMPTS = ["The list type is", "def f(x):", "Dictionaries are", "import os"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


@pytest.fixture(scope="module")
def reference_tokens():
    eng = LLMEngine(scheduler=SchedulerConfig(max_num_seqs=4))
    return [o.token_ids for o in eng.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("distance", [0, 1, 3])
def test_batched_paged_engine_streams_with_identical_tokens(reference_tokens, distance):
    eng = LLMEngine(scheduler=SchedulerConfig(max_num_seqs=4),
                    stream_weights=WeightStreamConfig(resident_layers=1, distance=distance, transport="disk"))
    try:
        assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == reference_tokens
        st = eng.stats()["prefetch"]["weights"]
        steps = eng.scheduler.step_no
        assert st["uses"] == 5 * steps                    # every streamed layer was waited for, every step
        assert st["streamed_layers"] == 5 and st["distance"] == distance
        assert st["bytes"] == st["uses"] * st["layer_bytes"]    # one layer-sized copy per use
        if distance == 0:
            assert st["demand"] == st["uses"] and st["prefetch_hit_rate"] == 0.0
        else:
            assert st["demand"] == 0 and st["predicted"] >= st["uses"]
        assert st["resident_bytes"] < st["all_resident_bytes"]
        assert "stream-weights resident=1/6" in eng.describe()
    finally:
        eng.weight_streamer.remove()


def test_compiled_static_path_runs_the_fetches(reference_tokens):
    """A plain compiled engine first, then a streaming one: the second must not reuse the first's
    compiled step (Dynamo does not guard on module hooks) - its tokens would come from stale buffers."""
    plain = LLMEngine(kv="contiguous", compile=True, scheduler=SchedulerConfig(max_num_seqs=4))
    plain_tokens = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    eng = LLMEngine(kv="contiguous", compile=True, scheduler=SchedulerConfig(max_num_seqs=4),
                    stream_weights=WeightStreamConfig(resident_layers=1, distance=1, transport="host"))
    try:
        assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == plain_tokens
        st = eng.stats()["prefetch"]["weights"]
        decode_steps = sum(1 for r in eng.step_records if r.decode_tokens)
        assert st["uses"] >= 5 * decode_steps             # the compiled decode steps waited for every layer
    finally:
        eng.weight_streamer.remove()


def test_stats_metrics_and_model_info_carry_the_prefetch_layer():
    llm = LLM(stream_weights=WeightStreamConfig(resident_layers=2, distance=2, transport="host"))
    try:
        llm.generate(["The list type"], SamplingParams(temperature=0, max_tokens=4))
        stats = llm.engine.stats()
        assert stats["prefetch"]["kv"] is None or isinstance(stats["prefetch"]["kv"], dict)
        text = ServerMetrics().render(stats, engine_alive=True)
        assert 'workbench_prefetch_hit_rate{kind="weights"}' in text
        assert 'workbench_prefetch_bytes_total{kind="weights"}' in text
        assert 'stream_weights="stream-weights resident=2/6 d=2 host 2.95MB/layer"' in text
        info = model_info(types.SimpleNamespace(engine=llm.engine), "m")
        assert info["stream_weights"]["resident_layers"] == 2 and info["stream_weights"]["transport"] == "host"
        assert info["engine"]["stream_weights"].startswith("stream-weights")
        assert stats["prefetch"]["weights"]["uses"] > 0
    finally:
        weight_streamer(llm.model).remove()


def test_engine_without_streaming_reports_it_off():
    eng = LLMEngine(model="preset:tiny", kv="contiguous")
    assert eng.stats()["prefetch"]["weights"] is None
    assert eng.fast_paths()["stream_weights"] == "off"
    text = ServerMetrics().render(eng.stats(), engine_alive=True)
    assert 'workbench_prefetch_hit_rate{kind="weights"}' not in text


def test_bad_streaming_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="WeightStreamConfig"):
        LLMEngine(model="preset:tiny", kv="contiguous", stream_weights={"resident_layers": 1})
    with pytest.raises(ConfigError, match="nothing to stream"):
        LLMEngine(model="preset:tiny", kv="contiguous", stream_weights=WeightStreamConfig(resident_layers=2))
    llm = LLM("preset:tiny", stream_weights=WeightStreamConfig(resident_layers=1, transport="host"))
    try:
        with pytest.raises(ConfigError, match="already streams"):
            LLMEngine(llm, stream_weights=WeightStreamConfig(resident_layers=0, transport="host"))
        same = LLMEngine(llm, kv="contiguous", stream_weights=WeightStreamConfig(resident_layers=1, transport="host"))
        assert same.weight_streamer is llm.engine.weight_streamer      # one model, one schedule: shared
    finally:
        weight_streamer(llm.model).remove()


def test_quantized_model_streams_on_the_paged_static_path():
    """W4A16 on the packed int4 CPU op, the paged static runner: the same tokens as the same
    quantized model without streaming, and every streamed layer's tensors in the buffers."""
    kv, sched = PagedKVConfig(block_size=8), SchedulerConfig(max_num_seqs=4)
    plain = LLMEngine(LLM(quant="w4a16:g128"), kv=kv, static_decode=True, scheduler=sched)
    want = [o.token_ids for o in plain.generate(PROMPTS, GREEDY)]
    eng = LLMEngine(LLM(quant="w4a16:g128"), kv=kv, static_decode=True, scheduler=sched,
                    stream_weights=WeightStreamConfig(resident_layers=1, distance=1, transport="host"))
    try:
        assert type(eng.runner).__name__ == "PagedStaticRunner"
        assert [o.token_ids for o in eng.generate(PROMPTS, GREEDY)] == want
        st = eng.stats()["prefetch"]["weights"]
        assert st["uses"] == 5 * eng.scheduler.step_no and st["streamed_layer_resident_bytes"] == 0
        assert "quant w4a16" in eng.describe() and "kB/layer" in eng.describe()
    finally:
        eng.weight_streamer.remove()


@pytest.mark.parametrize("kv", ["contiguous", "paged"])
def test_compiled_step_streams_a_quantized_model(kv):
    """``compile=True`` (each decoder its own code object, the hooks as graph breaks) on a W8A16
    model whose streamed layers' int8 weights and scales are buffer views: the fetches run every
    compiled decode step, and the tokens are the eager static step's (or part at a near-tie)."""
    from workbench.measure.agreement import divergence_margin

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    kvc = "contiguous" if kv == "contiguous" else PagedKVConfig(block_size=8)
    sched = SchedulerConfig(max_num_seqs=4)
    ref = LLM(quant="w8a16")
    want = [o.token_ids for o in LLMEngine(ref, kv=kvc, static_decode=True, scheduler=sched).generate(PROMPTS, params)]
    eng = LLMEngine(LLM(quant="w8a16"), kv=kvc, compile=True, scheduler=sched,
                    stream_weights=WeightStreamConfig(resident_layers=1, distance=1, transport="host"))
    try:
        outs = eng.generate(PROMPTS, params)
        assert [o.finish_reason for o in outs] == ["length"] * 4, outs[0].error
        assert eng.compiled
        for prompt, a, b in zip(PROMPTS, want, [o.token_ids for o in outs]):
            if a != b:
                d = divergence_margin(ref.model, ref.encode(prompt)[1], a, b)
                assert d["top2_gap"] < 1e-3, d
        st = eng.stats()["prefetch"]["weights"]
        decode_steps = sum(1 for r in eng.step_records if r.decode_tokens)
        assert st["uses"] >= 5 * decode_steps and st["streamed_layer_resident_bytes"] == 0
    finally:
        eng.weight_streamer.remove()
