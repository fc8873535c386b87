"""Weight streaming as a transformation of the plain model: greedy tokens identical to
all-resident at every distance, the resident-bytes budget, byte accounting, clear errors,
remove() restoring the model, and a model compiled before streaming was installed."""

from __future__ import annotations

import pytest
import torch

from workbench.engine.sampling import SamplingParams
from workbench.errors import ConfigError
from workbench.model.config import ModelConfig
from workbench.model.decoder import CausalLM, init_weights
from workbench.prefetch.weights import WeightStreamConfig, _layout, stream_weights, weight_streamer

PROMPTS = ["The list type is", "def f(x):"]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(bundled_llm):
    return [o.token_ids for o in bundled_llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("distance,transport", [(0, "disk"), (1, "disk"), (2, "disk"), (3, "disk"), (2, "host")])
def test_greedy_tokens_identical_to_all_resident(bundled_llm, reference, distance, transport):
    st = stream_weights(bundled_llm.model, WeightStreamConfig(resident_layers=2, distance=distance,
                                                               transport=transport))
    try:
        assert weight_streamer(bundled_llm.model) is st
        assert [o.token_ids for o in bundled_llm.generate(PROMPTS, GREEDY)] == reference
        s = st.stats()
        assert s["streamed_layers"] == 4 and s["uses"] > 0 and s["uses"] % 4 == 0
        assert s["bytes"] == s["uses"] * s["layer_bytes"]
        if distance == 0:
            assert s["demand"] == s["uses"] and s["prefetch_hit_rate"] == 0.0 and s["buffers"] == 1
        else:
            assert s["demand"] == 0 and s["buffers"] == min(distance + 1, 4)
        tl = st.prefetcher.timeline()
        assert {e["label"] for e in tl if e["lane"] == "copy"} == {"L2", "L3", "L4", "L5"}
        assert {e["label"] for e in tl if e["lane"] == "compute"} == {f"L{i}" for i in range(6)}
    finally:
        st.remove()


def test_byte_accounting_resident_plus_slow_tier_is_everything(bundled_llm):
    st = stream_weights(bundled_llm.model, resident_layers=1, distance=2, transport="host")
    try:
        m = st.memory()
        layer = _layout(bundled_llm.model.model.layers[0])[1]
        assert m["buffer_bytes"] == 3 * layer and m["slow_tier_bytes"] == 5 * layer
        assert m["resident_layer_bytes"] == layer
        assert m["resident_bytes"] - m["buffer_bytes"] + m["slow_tier_bytes"] == m["all_resident_bytes"]
        assert m["resident_bytes"] == m["embedding_head_norm_bytes"] + 4 * layer
    finally:
        st.remove()


def test_resident_bytes_budget_picks_the_largest_count_that_fits(bundled_llm):
    model = bundled_llm.model
    probe = stream_weights(model, resident_layers=3, distance=1, transport="host")
    fixed, layer = probe.fixed_bytes, probe.layer_bytes
    probe.remove()
    need = fixed + 3 * layer + 2 * layer                         # 3 resident + 2 buffers at distance 1
    for budget, n in [(need, 3), (need - 1, 2), (fixed + 2 * layer, 0)]:
        st = stream_weights(model, resident_bytes=budget, distance=1, transport="host")
        try:
            assert st.settings()["resident_layers"] == n
            assert st.memory()["resident_bytes"] <= budget
        finally:
            st.remove()
    with pytest.raises(ConfigError, match="resident_bytes=.* is too small"):
        stream_weights(model, resident_bytes=fixed, distance=1, transport="host")
    assert weight_streamer(model) is None


@pytest.mark.parametrize("kw,match", [
    (dict(), "give resident_layers or resident_bytes"),
    (dict(resident_layers=1, resident_bytes=10), "exactly one"),
    (dict(resident_layers=-1), "resident_layers must be an integer >= 0"),
    (dict(resident_bytes=0), "resident_bytes must be > 0"),
    (dict(resident_layers=1, distance=17), "distance must be an integer in 0..16"),
    (dict(resident_layers=1, distance=1.5), "distance must be an integer"),
    (dict(resident_layers=1, transport="ssd"), "transport must be auto, disk, host or cuda"),
])
def test_bad_configs_are_clear(kw, match):
    with pytest.raises(ConfigError, match=match):
        WeightStreamConfig(**kw)


def test_nothing_to_stream_and_double_install_are_clear(bundled_llm):
    with pytest.raises(ConfigError, match="keeps all 6 decoder layers resident"):
        stream_weights(bundled_llm.model, resident_layers=6, transport="host")
    st = stream_weights(bundled_llm.model, resident_layers=5, transport="host")
    try:
        with pytest.raises(ConfigError, match="already streams"):
            stream_weights(bundled_llm.model, resident_layers=4, transport="host")
    finally:
        st.remove()


def test_remove_restores_owned_parameters_and_no_hooks(bundled_llm, reference):
    model = bundled_llm.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    st = stream_weights(model, resident_layers=0, distance=2, transport="disk")
    bufs = [b.untyped_storage().data_ptr() for b in st.buffers]
    path = st.transport.path
    bundled_llm.generate(PROMPTS[:1], GREEDY)
    st.remove()
    assert weight_streamer(model) is None and not path.exists()
    for layer in model.model.layers:
        assert not layer._forward_pre_hooks and not layer._forward_hooks
    for n, p in model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.untyped_storage().data_ptr() not in bufs, n
    assert [o.token_ids for o in bundled_llm.generate(PROMPTS, GREEDY)] == reference


def _tiny() -> CausalLM:
    cfg = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return init_weights(CausalLM(cfg), seed=1).eval()


def test_plain_forward_tiny_model_all_transports_and_distances(tmp_path):
    model, ids = _tiny(), torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model(ids)
        for d in range(4):
            st = stream_weights(model, WeightStreamConfig(resident_layers=0, distance=d, transport="disk",
                                                          path=str(tmp_path / f"w{d}.bin")))
            try:
                for _ in range(3):                                # across steps: the buffers rotate
                    assert torch.equal(model(ids), ref)
                assert st.stats()["uses"] == 9
            finally:
                st.remove()


class _Step:
    """A compiled step over the layers, as the engine's static decode path has it (a method of
    an object that holds the model, not the model's own forward)."""

    def __init__(self, model):
        self.model = model

    def forward(self, x, cos, sin):
        for layer in self.model.model.layers:
            x = layer(x, cos, sin, 0, None)
        return x


@pytest.mark.slow
def test_a_step_compiled_before_streaming_still_runs_the_fetches():
    """Dynamo does not guard on hooks being added: code compiled before install would skip the
    fetches and compute on whatever the buffers hold.  Installing drops compiled code."""
    model = _tiny().requires_grad_(False)
    x = torch.randn(1, 4, 32, generator=torch.Generator().manual_seed(0))
    cos, sin = model.model.rotary_emb(0, 4, x.device, x.dtype)
    fn = torch.compile(_Step(model).forward, dynamic=False)
    with torch.inference_mode():
        ref = fn(x, cos, sin)
    st = stream_weights(model, resident_layers=0, distance=1, transport="host")     # outside inference mode
    try:
        with torch.inference_mode():
            for _ in range(2):
                assert torch.allclose(fn(x, cos, sin), ref, atol=1e-5)
        assert st.stats()["uses"] == 6
    finally:
        st.remove()
    with torch.inference_mode():
        assert torch.allclose(fn(x, cos, sin), ref, atol=1e-5)
