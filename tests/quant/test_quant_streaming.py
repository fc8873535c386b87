"""Weight streaming of quantized models: a streamed quantized layer's packed bytes (int8 / int4
integers, scales, zero points, and the copies a backend's op keeps, e.g. the int4 CPU op's
repacked weight) are views into the streaming buffers, so a fetch moves the quantized bytes and
nothing of a streamed layer stays resident; greedy tokens equal the same quantized model's
without streaming, exactly (the same bytes are computed), for ``LLM(quant=...)`` recipes and a
compressed-tensors checkpoint folder, on the packed CPU ops (``auto``) and on the reference."""

from __future__ import annotations

import pytest
import torch

import workbench as wb
from workbench.engine.sampling import SamplingParams
from workbench.errors import ConfigError
from workbench.prefetch.weights import WeightStreamConfig, forward_tensors, stream_weights, weight_streamer
from workbench.quant.apply import QuantLinear, set_quant_backend

if not (wb.BUNDLED_MODEL / "model.safetensors").is_file():
    pytest.skip("bundled model weights not present", allow_module_level=True)

PROMPTS = ["The list type is", "def f(x):", "Dictionaries are", "import os"]
GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _tokens(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _held(mod) -> list[torch.Tensor]:
    """What a layer reads at forward time, found here on its own: its parameters and buffers and
    the tensors in its compute op's closure (a backend's repacked copy)."""
    ts = list(mod.parameters(recurse=False)) + list(mod.buffers(recurse=False))
    op = getattr(mod, "_op", None)
    if op is not None:
        ts += [c.cell_contents for c in op.__closure__ or () if isinstance(c.cell_contents, torch.Tensor)]
    return ts


def _span(t: torch.Tensor) -> tuple[int, int]:
    lo = t.data_ptr()
    return lo, lo + (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()


def _in(t: torch.Tensor, buffers) -> bool:
    lo, hi = _span(t)
    return any(b.data_ptr() <= lo and hi <= b.data_ptr() + b.numel() for b in buffers)


def _assert_all_streamed(model, st) -> None:
    """Every tensor a streamed layer reads lies inside a streaming buffer (by address), and the
    streamer's own accounting says the same: nothing of a streamed layer is resident."""
    layers = model.model.layers
    n_ops = 0
    for i in st.streamed:
        for name, mod in layers[i].named_modules():
            n_ops += getattr(mod, "_op", None) is not None
            for t in _held(mod):
                assert _in(t, st.buffers), (i, name, tuple(t.shape), t.dtype)
    m = st.memory()
    assert m["streamed_layer_resident_bytes"] == 0
    assert m["resident_bytes"] == m["embedding_head_norm_bytes"] + m["resident_layer_bytes"] + m["buffer_bytes"]
    assert m["resident_bytes"] - m["buffer_bytes"] + m["slow_tier_bytes"] == m["all_resident_bytes"]
    placement = getattr(model, "quant_backend", {}).get("layers", {})
    assert (n_ops > 0) == bool(placement.get("cpu")), placement     # the packed ops' tensors were checked too


def _restored(model, want_model, st_buffers) -> None:
    got = dict(forward_tensors(model))
    for name, t in forward_tensors(want_model):
        assert torch.equal(got[name], t), name
        assert not _in(got[name], st_buffers), name


CASES = [("w8a16", "auto", dict(resident_layers=1, distance=2, transport="disk")),
         ("w8a16", "reference", dict(resident_layers=2, distance=0, transport="host")),
         ("w4a16:g128", "auto", dict(resident_layers=1, distance=1, transport="host")),
         ("w4a16:g128", "reference", dict(resident_layers=0, distance=3, transport="disk")),
         ("w8a8", "auto", dict(resident_layers=3, distance=1, transport="disk")),
         ("w8a8", "reference", dict(resident_layers=1, distance=1, transport="host"))]


@pytest.mark.parametrize("recipe,backend,stream", CASES, ids=[f"{r}-{b}" for r, b, _ in CASES])
def test_quantized_model_streams_its_packed_bytes_with_identical_tokens(recipe, backend, stream):
    plain = wb.LLM(quant=recipe, quant_backend=backend)
    want = _tokens(plain)
    llm = wb.LLM(quant=recipe, quant_backend=backend, stream_weights=WeightStreamConfig(**stream))
    st = weight_streamer(llm.model)
    try:
        assert _tokens(llm) == want
        _assert_all_streamed(llm.model, st)
        s = st.stats()
        assert s["uses"] > 0 and s["uses"] % len(st.streamed) == 0
        assert s["bytes"] == s["uses"] * s["layer_bytes"]          # one layer of quantized bytes per use
        assert s["weights"] == llm.model.recipe.name
        assert f"quant {llm.model.recipe.name}" in llm.engine.describe() and "/layer" in llm.engine.describe()
    finally:
        bufs = list(st.buffers)
        st.remove()
    _restored(llm.model, plain.model, bufs)
    assert _tokens(llm) == want


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """``workbench quantize bundled --scheme w4a16:g128``: a compressed-tensors folder."""
    from workbench.cli.main import main

    out = tmp_path_factory.mktemp("ct") / "w4a16"
    assert main(["quantize", "bundled", "--scheme", "w4a16:g128", "--out", str(out), "--json"]) == 0
    return out


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_compressed_checkpoint_streams_with_identical_tokens(checkpoint, backend):
    plain = wb.LLM(str(checkpoint), quant_backend=backend)
    want = _tokens(plain)
    llm = wb.LLM(str(checkpoint), quant_backend=backend,
                 stream_weights=WeightStreamConfig(resident_layers=2, distance=1, transport="disk"))
    st = weight_streamer(llm.model)
    try:
        assert _tokens(llm) == want
        _assert_all_streamed(llm.model, st)
    finally:
        bufs = list(st.buffers)
        st.remove()
    _restored(llm.model, plain.model, bufs)


def test_streamed_layer_bytes_are_the_stored_quantized_bytes():
    """Measured: the bytes one fetch moves per streamed layer, against the same layer's tensors
    counted here from the all-resident model (each storage once; the buffer adds at most 64 bytes
    of alignment per storage).  int4 through the CPU op streams one copy of the weight (the op's
    layout) and the op's scales-and-zeros beside the stored scales: under W8A16's bytes."""
    got = {}
    for name, kw in [("fp32", {}), ("w8a16", {"quant": "w8a16"}),
                     ("w4a16 reference", {"quant": "w4a16:g128", "quant_backend": "reference"}),
                     ("w4a16 cpu op", {"quant": "w4a16:g128"})]:
        layer = wb.LLM(**kw).model.model.layers[1]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for mod in layer.modules() for t in _held(mod)}
        llm = wb.LLM(stream_weights=WeightStreamConfig(resident_layers=1, distance=1, transport="host"), **kw)
        st = weight_streamer(llm.model)
        try:
            s = st.stats()
            got[name] = s["streamed_layer_bytes"]
            assert sum(storages.values()) <= got[name] < sum(storages.values()) + 64 * len(storages), name
            assert s["layer_bytes"] == got[name]                       # the bundled model's layers are alike
        finally:
            st.remove()
    print(got)
    assert got["w8a16"] < 0.3 * got["fp32"]
    assert got["w4a16 reference"] < 0.15 * got["fp32"]
    assert got["w4a16 reference"] < got["w4a16 cpu op"] < 1.2 * got["w4a16 reference"]
    assert got["w4a16 cpu op"] < got["w8a16"]


class _Opaque:
    """A compute op whose tensors the streamer cannot see (not a plain function)."""

    def __init__(self, layer):
        self.w = layer.quantized.dequantize(torch.float32)

    def __call__(self, x):
        return torch.nn.functional.linear(x, self.w)


def test_what_cannot_stream_is_refused_clearly():
    llm = wb.LLM(quant="w8a16", quant_backend="reference")
    want = _tokens(llm)
    q = llm.model.model.layers[5].mlp.down_proj
    assert isinstance(q, QuantLinear)
    q._op = _Opaque(q)
    with pytest.raises(ConfigError, match=r"layers\.5\.mlp\.down_proj\._op is a _Opaque.*quant_backend='reference'"):
        stream_weights(llm.model, resident_layers=1, transport="host")
    assert weight_streamer(llm.model) is None
    q._op = None
    assert _tokens(llm) == want                                       # refused before anything moved
    st = stream_weights(llm.model, resident_layers=1, transport="host")
    try:
        with pytest.raises(ConfigError, match="streams its weights; choose the backend before"):
            set_quant_backend(llm.model, "auto")
    finally:
        st.remove()
