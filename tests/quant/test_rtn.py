"""Round-to-nearest weight quantization: packing, granularities, the recipe and its group
fallback, the quantized model against the plain one, and LLM(quant=...) in the batched engine."""

from __future__ import annotations


import pytest
import torch

from workbench.bench.quant import perplexity
from workbench.errors import ConfigError
from workbench.quant.apply import QuantLinear, quantization_report, quantize_model, weight_bytes
from workbench.quant.recipe import QuantRecipe
from workbench.quant.rtn import pack_int4, qrange, quantize_weight, unpack_int4

torch.manual_seed(0)


def test_int4_packing_is_bit_exact():
    x = torch.randint(0, 16, (5, 64), dtype=torch.uint8)
    p = pack_int4(x)
    assert p.shape == (5, 32) and p.dtype == torch.uint8
    assert torch.equal(unpack_int4(p), x)
    assert int(p[0, 0]) == int(x[0, 0]) | (int(x[0, 1]) << 4)          # low nibble = even column
    with pytest.raises(ConfigError, match="even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.uint8))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("gran", [dict(group=None, per_channel=False), dict(group=None, per_channel=True),
                                  dict(group=32)], ids=["per-tensor", "per-channel", "g32"])
def test_round_to_nearest_error_is_at_most_half_a_step(bits, symmetric, gran):
    w = torch.randn(48, 128) * torch.linspace(0.1, 3, 128)               # columns of different ranges
    q = quantize_weight(w, bits=bits, symmetric=symmetric, **gran)
    d = q.dequantize()
    lo, hi = qrange(bits, symmetric)
    v = q.int_values()
    assert int(v.min()) >= lo and int(v.max()) <= hi
    step = q.scales if q.scales.shape[0] == 48 else q.scales.expand(48, -1)
    step = step.repeat_interleave(q.group_size, dim=1)                   # [48, 128]
    assert ((d - w).abs() <= step / 2 + 1e-6).all()
    assert q.nbytes < w.numel() * 4 * (0.6 if bits == 8 else 0.35)


def test_finer_granularity_lowers_the_error_on_uneven_columns():
    w = torch.randn(64, 256) * torch.linspace(0.05, 4, 256)
    err = {}
    for name, kw in (("per-tensor", dict(per_channel=False)), ("per-channel", {}), ("g32", dict(group=32))):
        err[name] = float((quantize_weight(w, bits=4, **kw).dequantize() - w).norm() / w.norm())
    assert err["g32"] < err["per-channel"] < err["per-tensor"]


def test_recipe_names_parses_and_states_the_group_fallback():
    r = QuantRecipe.parse("w4a16:g128")
    assert r.name == "w4a16-g128-sym-rtn-fallback=pow2" and r.scheme == "w4a16"
    assert r.layer_settings("model.layers.0.mlp.down_proj", 704)["group"] == 64          # 704 = 5*128 + 64
    assert r.layer_settings("model.layers.0.mlp.down_proj", 704)["fallback"] == "g128 -> g64"
    assert r.layer_settings("model.layers.0.mlp.up_proj", 256)["group"] == 128
    pc = QuantRecipe.parse("w4a16:g128:fallback=per-channel").layer_settings("x.down_proj", 704)
    assert pc["group"] is None and pc["per_channel"] and pc["fallback"] == "g128 -> per-channel"
    odd = r.layer_settings("x", 7 * 5)                                                    # no power of two >= 8
    assert odd["group"] is None and odd["fallback"] == "g128 -> per-channel"
    ov = QuantRecipe(weight_bits=4, group=64, overrides=(("down_proj", {"weight_bits": 8}),))
    assert ov.layer_settings("m.down_proj", 704)["bits"] == 8 and ov.layer_settings("m.up_proj", 256)["bits"] == 4
    assert QuantRecipe.parse("w8a16:pt:asym").name == "w8a16-per-tensor-asym-rtn"
    for bad in ("w3a16", "w4a16:g0x", "w4a16:zz", "w4a16:g127"):
        with pytest.raises(ConfigError):
            QuantRecipe.parse(bad)
    with pytest.raises(ConfigError, match="overrides"):
        QuantRecipe(overrides=(("down_proj", {"colour": 1}),))


@pytest.fixture(scope="module")
def docs(bundled_llm):
    from workbench.bench.tier_eval import heldout_split

    return heldout_split(bundled_llm.tokenizer, 256)["evaluation"][:2]


def test_quantized_bundled_model(bundled_llm, docs):
    import workbench as wb

    p0 = perplexity(bundled_llm.model, docs)
    res = {}
    for spec in ("w8a16", "w4a16:g128"):
        m = wb.load_model().eval()
        quantize_model(m, spec)
        res[spec] = (perplexity(m, docs), weight_bytes(m), quantization_report(m))
        assert m.recipe.name.startswith(spec.split(":")[0])
        assert m.lm_head.__class__.__name__ == "Linear" and not isinstance(m.model.embed_tokens, QuantLinear)
        with pytest.raises(ConfigError, match="already quantized"):
            quantize_model(m, spec)
    assert res["w8a16"][0] / p0 - 1 < 0.01                         # int8 per channel: close to fp32
    assert res["w4a16:g128"][0] / p0 - 1 < 0.05
    rows = res["w4a16:g128"][2]
    assert {r["granularity"] for r in rows if r["layer"].endswith("down_proj")} == {"g64"}
    assert all(r["fallback"] is None for r in rows if not r["layer"].endswith("down_proj"))
    w4, w8 = res["w4a16:g128"][1]["quantized_linears"], res["w8a16"][1]["quantized_linears"]
    dense_bf16 = sum(r["dense_bytes_bf16"] for r in rows)
    assert w4 < 0.3 * dense_bf16 and w4 < 0.6 * w8


@pytest.mark.parametrize("spec,name", [("w4a16:g128", "w4a16-g128-sym-rtn-fallback=pow2"),
                                       ("w8a8", "w8a8-per-channel-sym-rtn")])
def test_llm_quant_batched_equals_unbatched(bundled_llm, spec, name):
    """The batched engine with torch's packed CPU ops (the default backend on a CPU) gives the
    greedy tokens of one-at-a-time generation through the reference (dequantize, then matmul)."""
    import workbench as wb
    from workbench import SamplingParams
    from workbench.sched import SchedulerConfig

    prompts = ["The list type", "Dictionaries are", "A module is a file"]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = wb.LLM(quant=spec, quant_backend="reference")
    batched = wb.LLM(quant=spec, scheduler=SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=256))
    assert one.quant_placement["layers"] == {"reference": 42}
    assert batched.quant_placement["layers"] == {"cpu": 42}         # 6 layers x 7 linears (down_proj g64: int4 op)
    a = [o.token_ids for o in one.generate(prompts, sp)]
    b = [o.token_ids for o in batched.generate(prompts, sp)]
    assert a == b and one.model.recipe.name == name


def test_serve_names_the_scheme(bundled_llm):
    import json

    import httpx

    import workbench as wb
    from workbench.engine import LLMEngine
    from workbench.serve import ServerConfig, start_server

    llm = wb.LLM(quant="w8a16")
    with start_server(LLMEngine(llm), ServerConfig(port=0)) as srv, httpx.Client(base_url=srv.url, timeout=60) as h:
        r = h.post("/v1/completions", json={"prompt": "The list type", "max_tokens": 3})
        assert r.status_code == 200
        info = json.loads(r.headers["x-model-info"])
        assert info["quant"]["name"] == "w8a16-per-channel-sym-rtn" and "fp32 on a CPU" in info["quant"]["activations"]
        assert info["quant"]["placement"]["layers"] == {"cpu": 42}
        assert 'quant="w8a16-per-channel-sym-rtn"' in h.get("/metrics").text


def test_refusals_name_what_and_why(random_llm):
    import workbench as wb
    from workbench.model.decoder import CausalLM, init_weights
    from workbench.prefetch.weights import WeightStreamConfig
    from workbench.quant.apply import set_quant_backend

    def fresh():
        return init_weights(CausalLM(random_llm.model.config), seed=3).eval()

    with pytest.raises(ConfigError, match="LM head is quantized round-to-nearest only"):
        quantize_model(fresh(), QuantRecipe(weight_bits=8, method="gptq", skip=("embed_tokens",)))
    with pytest.raises(ConfigError, match="unknown fields"):
        QuantRecipe(weight_bits=4, overrides=(("down_proj", {"method": "gptq"}),))
    m = quantize_model(fresh(), "w4a16:pc")                   # per channel: no int4 CPU op, no GPU here
    with pytest.raises(ConfigError, match="runs none of the 14 quantized layers"):
        set_quant_backend(m, "cpu")
    assert set_quant_backend(m, "auto")["fallbacks"] == {"int4 op: groups of (32, 64, 128, 256) only "
                                                         "(this layer: no group)": 14}
    llm = wb.LLM(fresh(), tokenizer=random_llm.tokenizer, quant="w8a16",
                 stream_weights=WeightStreamConfig(resident_layers=1, transport="host"))
    with pytest.raises(ConfigError, match="streams its weights"):      # the packed bytes are in its buffers now
        set_quant_backend(llm.model, "reference")
    llm.engine.weight_streamer.remove()


def test_a_quantized_head_keeps_the_tie_and_computes_from_its_copy(random_llm):
    """``w8a16:head``: the LM head computes from an int8 copy; its float weight stays the embedding's
    (a tie stays a tie), and its logits are the reference's dequantized product."""
    from workbench.model.decoder import CausalLM, init_weights
    from workbench.quant.apply import QuantHead, set_quant_backend

    model = init_weights(CausalLM(random_llm.model.config), seed=3).eval()
    emb = model.model.embed_tokens.weight
    quantize_model(model, "w8a16:head")
    assert isinstance(model.lm_head, QuantHead) and model.lm_head.weight is emb
    assert model.recipe.name.endswith("-head") and QuantRecipe.parse("w8a8:head").skip == ("embed_tokens",)
    x = torch.randn(3, model.config.hidden_size)
    want = torch.nn.functional.linear(x, model.lm_head.q.quantized.dequantize(torch.float32))
    with torch.inference_mode():
        assert torch.allclose(model.lm_head(x), want, atol=1e-5)
        set_quant_backend(model, "auto")
        assert torch.allclose(model.lm_head(x), want, atol=1e-4)        # the CPU op: the compiled int8 reduction
