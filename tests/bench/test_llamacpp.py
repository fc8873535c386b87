"""The optional llama.cpp row: GGUF export (needs the `gguf` package) and the unavailable path.

None of these tests needs llama-cpp-python; the ones that write GGUF files skip when `gguf`
is not installed (it is not a dependency of the workbench).
"""

from __future__ import annotations

import shutil
import sys
import types

import pytest
import torch

import workbench
from workbench.model.config import ModelConfig
from workbench.errors import CheckpointError, WorkbenchError
from workbench.bench.gguf_export import export_gguf, gguf_tensor_name, permute_qk
from workbench.bench.llamacpp import cached_gguf, llamacpp_decode_rate, llamacpp_row, llamacpp_unavailable_reason
from workbench.model.loader import save_model
from workbench.model.decoder import CausalLM, init_weights, rope_inv_freq

BUNDLED_READY = (workbench.BUNDLED_MODEL / "model.safetensors").is_file()
needs_bundled = pytest.mark.skipif(not BUNDLED_READY, reason="bundled model weights not present")

try:
    import gguf
except ImportError:
    gguf = None
needs_gguf = pytest.mark.skipif(gguf is None, reason="the optional `gguf` package is not installed "
                                                     "(pip install gguf) — GGUF export is not tested")


def _hide_module(monkeypatch, name: str) -> None:
    """Make ``import name`` fail as if the package were not installed."""
    monkeypatch.setitem(sys.modules, name, None)


def _fields(reader) -> dict:
    out = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        out[key] = field.contents()
    return out


# ---- pure helpers (no optional package) ------------------------------------------------------

def test_tensor_names_map_to_llama_cpp():
    assert gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    assert gguf_tensor_name("model.norm.weight") == "output_norm.weight"
    assert gguf_tensor_name("lm_head.weight") == "output.weight"
    assert gguf_tensor_name("model.layers.3.self_attn.q_proj.weight") == "blk.3.attn_q.weight"
    assert gguf_tensor_name("model.layers.3.self_attn.k_proj.bias") == "blk.3.attn_k.bias"
    assert gguf_tensor_name("model.layers.0.self_attn.o_proj.weight") == "blk.0.attn_output.weight"
    assert gguf_tensor_name("model.layers.11.mlp.down_proj.weight") == "blk.11.ffn_down.weight"
    assert gguf_tensor_name("model.layers.1.input_layernorm.weight") == "blk.1.attn_norm.weight"
    assert gguf_tensor_name("model.layers.1.post_attention_layernorm.weight") == "blk.1.ffn_norm.weight"
    assert gguf_tensor_name("model.layers.1.self_attn.rotary_emb.inv_freq") is None
    with pytest.raises(CheckpointError, match="no llama.cpp equivalent"):
        gguf_tensor_name("model.layers.1.block_sparse_moe.gate.weight")


def _rope(x, pos, inv_freq, interleaved: bool):
    """RoPE on the last dim of x [T, H, D]: rotate halves (Hugging Face) or adjacent pairs (ggml)."""
    ang = pos[:, None].float() * inv_freq[None, :]                     # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def test_qk_permutation_turns_rotate_half_into_pairwise_rope():
    """Attention scores of the permuted weights under llama.cpp's pairwise RoPE equal those of
    the original weights under Hugging Face's rotate-half RoPE (GQA: 4 query, 2 KV heads)."""
    g = torch.Generator().manual_seed(0)
    hidden, d, nq, nkv, T = 32, 8, 4, 2, 7
    wq, wk = torch.randn(nq * d, hidden, generator=g), torch.randn(nkv * d, hidden, generator=g)
    x = torch.randn(T, hidden, generator=g)
    pos = torch.arange(T)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))

    def scores(wq, wk, interleaved):
        q = _rope((x @ wq.T).view(T, nq, d), pos, inv_freq, interleaved)
        k = _rope((x @ wk.T).view(T, nkv, d), pos, inv_freq, interleaved)
        k = k.repeat_interleave(nq // nkv, dim=1)
        return torch.einsum("thd,shd->hts", q, k)

    ref = scores(wq, wk, interleaved=False)
    ours = scores(permute_qk(wq, nq), permute_qk(wk, nkv), interleaved=True)
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)
    # ...and without the permutation the scores differ (the test can fail)
    assert not torch.allclose(scores(wq, wk, interleaved=True), ref, atol=1e-2)
    # a bias (1-D) permutes the same way as the weight's rows
    b = torch.arange(nq * d).float()
    assert permute_qk(b, nq)[:4].tolist() == [0.0, 4.0, 1.0, 5.0]


# ---- the unavailable row ---------------------------------------------------------------------

def test_row_is_unavailable_without_llama_cpp(monkeypatch):
    _hide_module(monkeypatch, "llama_cpp")
    reason = llamacpp_unavailable_reason()
    assert reason and "llama-cpp-python" in reason
    row = llamacpp_row(None, [1, 2, 3], 8, threads=1)
    assert row["available"] is False and row["engine"] == "llama.cpp"
    assert "llama-cpp-python" in row["reason"]
    with pytest.raises(WorkbenchError, match="llama-cpp-python"):
        llamacpp_decode_rate("missing.gguf", [1, 2, 3], 8, threads=1)


def test_row_is_unavailable_without_gguf(monkeypatch):
    _hide_module(monkeypatch, "gguf")
    row = llamacpp_row(None, [1, 2, 3], 8, threads=1)
    assert row["available"] is False and "pip install gguf" in row["reason"]


def test_export_names_the_missing_gguf_package(monkeypatch, tmp_path):
    _hide_module(monkeypatch, "gguf")
    with pytest.raises(WorkbenchError, match="pip install gguf"):
        export_gguf(workbench.BUNDLED_MODEL, tmp_path / "m.gguf")
    assert not list(tmp_path.iterdir())


def test_preset_has_no_checkpoint(monkeypatch):
    # stand-in modules, so both imports succeed and the preset check is what answers
    for name in ("llama_cpp", "gguf"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    assert llamacpp_unavailable_reason() is None
    row = llamacpp_row("preset:llama-3.2-1b", [1, 2], 4, threads=1)
    assert row["available"] is False and "preset" in row["reason"]


# ---- GGUF export (needs gguf) ----------------------------------------------------------------

@needs_gguf
@needs_bundled
def test_export_bundled_model_reads_back(tmp_path):
    cfg = workbench.model.loader.read_config(workbench.BUNDLED_MODEL)
    path = export_gguf(workbench.BUNDLED_MODEL, tmp_path / "ref.gguf")
    assert path == tmp_path / "ref.gguf" and [p.name for p in tmp_path.iterdir()] == ["ref.gguf"]
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    # tied embeddings: no output.weight; 9 tensors per block + token_embd + output_norm
    assert len(tensors) == 9 * cfg.num_hidden_layers + 2
    assert "output.weight" not in tensors
    h, i, kv = cfg.hidden_size, cfg.intermediate_size, cfg.kv_size
    expect = {  # GGUF lists dimensions innermost first: [in, out]
        "token_embd.weight": [h, cfg.vocab_size], "output_norm.weight": [h],
        "blk.0.attn_q.weight": [h, cfg.q_size], "blk.0.attn_k.weight": [h, kv], "blk.0.attn_v.weight": [h, kv],
        "blk.0.attn_output.weight": [cfg.q_size, h], "blk.5.ffn_gate.weight": [h, i],
        "blk.5.ffn_up.weight": [h, i], "blk.5.ffn_down.weight": [i, h], "blk.5.attn_norm.weight": [h],
        "blk.5.ffn_norm.weight": [h],
    }
    for name, shape in expect.items():
        assert tensors[name].shape.tolist() == shape, name
        assert tensors[name].tensor_type == gguf.GGMLQuantizationType.F32
    f = _fields(reader)
    assert f["general.architecture"] == "llama"
    assert f["llama.context_length"] == cfg.max_position_embeddings
    assert f["llama.embedding_length"] == h
    assert f["llama.block_count"] == cfg.num_hidden_layers
    assert f["llama.feed_forward_length"] == i
    assert f["llama.attention.head_count"] == cfg.num_attention_heads
    assert f["llama.attention.head_count_kv"] == cfg.num_key_value_heads
    assert f["llama.rope.dimension_count"] == cfg.head_dim
    assert f["llama.rope.freq_base"] == pytest.approx(cfg.rope_theta)
    assert f["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(cfg.rms_norm_eps)
    assert f["llama.vocab_size"] == cfg.vocab_size
    # byte-level BPE tokenizer, in id order
    tok = workbench.Tokenizer(workbench.BUNDLED_MODEL)._tok
    assert f["tokenizer.ggml.model"] == "gpt2" and f["tokenizer.ggml.pre"] == "gpt-2"
    tokens = f["tokenizer.ggml.tokens"]
    assert len(tokens) == cfg.vocab_size
    assert [tokens[j] for j in (0, 1, 500, 8191)] == [tok.id_to_token(j) for j in (0, 1, 500, 8191)]
    types = f["tokenizer.ggml.token_type"]
    assert types[0] == gguf.TokenType.CONTROL and types[500] == gguf.TokenType.NORMAL
    assert len(f["tokenizer.ggml.merges"]) > 0 and " " in f["tokenizer.ggml.merges"][0]
    assert f["tokenizer.ggml.bos_token_id"] == 0 and f["tokenizer.ggml.eos_token_id"] == 0
    # the data: embeddings verbatim, q rows permuted per head
    from safetensors import safe_open
    with safe_open(str(workbench.BUNDLED_MODEL / "model.safetensors"), "pt") as st:
        emb = st.get_tensor("model.embed_tokens.weight").float()
        wq = st.get_tensor("model.layers.0.self_attn.q_proj.weight").float()
    assert torch.equal(torch.from_numpy(tensors["token_embd.weight"].data.copy()).view_as(emb), emb)
    got_q = torch.from_numpy(tensors["blk.0.attn_q.weight"].data.copy()).view_as(wq)
    assert torch.equal(got_q, permute_qk(wq, cfg.num_attention_heads))


@needs_gguf
def test_export_untied_f16_with_llama3_rope(tmp_path, bundled_tokenizer):
    cfg = ModelConfig(vocab_size=bundled_tokenizer.vocab_size, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=False, eos_token_id=0, bos_token_id=0,
                      rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                    "high_freq_factor": 4.0, "original_max_position_embeddings": 16})
    folder = tmp_path / "tiny"
    save_model(init_weights(CausalLM(cfg), seed=1), folder)
    shutil.copy(workbench.BUNDLED_MODEL / "tokenizer.json", folder / "tokenizer.json")
    reader = gguf.GGUFReader(str(export_gguf(folder, tmp_path / "tiny.gguf", dtype="f16")))
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 9 * 2 + 3 + 1           # + output.weight + rope_freqs.weight
    assert tensors["output.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.1.attn_q.weight"].tensor_type == gguf.GGMLQuantizationType.F16
    assert tensors["blk.1.attn_norm.weight"].tensor_type == gguf.GGMLQuantizationType.F32
    # llama.cpp divides each base frequency by its factor: base / factor == our scaled frequency
    factors = torch.from_numpy(tensors["rope_freqs.weight"].data.copy())
    base = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    torch.testing.assert_close(base / factors, rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling))
    assert factors.max().item() == pytest.approx(8.0)


@needs_gguf
def test_cached_gguf_exports_once_and_tracks_the_checkpoint(tmp_path, bundled_tokenizer):
    cfg = ModelConfig(vocab_size=bundled_tokenizer.vocab_size, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=64, tie_word_embeddings=True, eos_token_id=0)
    folder = tmp_path / "tiny"
    save_model(init_weights(CausalLM(cfg), seed=1), folder)
    shutil.copy(workbench.BUNDLED_MODEL / "tokenizer.json", folder / "tokenizer.json")
    cache = tmp_path / "cache"
    first = cached_gguf(folder, cache)
    stamp = first.stat().st_mtime_ns
    assert cached_gguf(folder, cache) == first and first.stat().st_mtime_ns == stamp
    save_model(init_weights(CausalLM(cfg), seed=2), folder)       # a new checkpoint: a new file
    second = cached_gguf(folder, cache)
    assert second != first and second.is_file()
