"""Tensor names and the RoPE row order between Hugging Face Llama-family checkpoints and llama.cpp's
GGUF files, shared by the exporter (:mod:`workbench.bench.gguf_export`) and the importer
(:mod:`workbench.model.gguf_import`).

* Names: ``model.layers.3.self_attn.q_proj.weight`` <-> ``blk.3.attn_q.weight`` (:func:`gguf_tensor_name`,
  :func:`hf_tensor_name`).
* RoPE: Hugging Face Llama checkpoints rotate the two *halves* of each head (``rotate_half``), llama.cpp's
  ``llama`` architecture rotates adjacent *pairs*: ``q_proj`` / ``k_proj`` rows are permuted within each
  head (:func:`permute_qk`, undone by :func:`unpermute_qk`).  Qwen2 (llama.cpp's ``qwen2``) rotates
  halves like Hugging Face and is not permuted.
"""

from __future__ import annotations

from workbench.errors import CheckpointError, ConfigError

# Hugging Face per-layer tensor name (after "model.layers.N.") -> llama.cpp's (after "blk.N.")
_LAYER_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
# Buffers some exporters write that llama.cpp recomputes.
_SKIPPED_SUFFIXES = ("rotary_emb.inv_freq",)
# workbench architecture -> (llama.cpp architecture, permute q/k for interleaved RoPE)
_ARCHS = {"LlamaForCausalLM": ("llama", True), "MistralForCausalLM": ("llama", True),
          "Qwen2ForCausalLM": ("qwen2", False)}


_GGUF_TOP = {v: k for k, v in _TOP_NAMES.items()}
_GGUF_LAYER = {v: k for k, v in _LAYER_NAMES.items()}


def permute_qk(w, n_heads: int):
    """Reorder the rows of a q_proj / k_proj weight (or bias) of ``n_heads`` heads from
    Hugging Face's rotate-half RoPE layout to llama.cpp's adjacent-pair layout.

    Within each head of ``d`` rows, output row ``2j`` is input row ``j`` and output row
    ``2j + 1`` is input row ``j + d/2``.
    """
    rows = w.shape[0]
    head = rows // n_heads
    if head * n_heads != rows or head % 2:
        raise ConfigError(f"cannot permute a {tuple(w.shape)} q/k weight into {n_heads} heads of even size")
    return w.reshape(n_heads, 2, head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensor_name(hf_name: str) -> str | None:
    """llama.cpp's name for a Hugging Face Llama tensor name; None for a buffer to skip."""
    if hf_name.endswith(_SKIPPED_SUFFIXES):
        return None
    base, dot, kind = hf_name.rpartition(".")
    if kind not in ("weight", "bias") or not dot:
        raise CheckpointError(f"tensor '{hf_name}': expected a name ending in .weight or .bias")
    if base in _TOP_NAMES:
        return f"{_TOP_NAMES[base]}.{kind}"
    parts = base.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and parts[3] in _LAYER_NAMES:
        return f"blk.{int(parts[2])}.{_LAYER_NAMES[parts[3]]}.{kind}"
    raise CheckpointError(f"tensor '{hf_name}' has no llama.cpp equivalent known to this exporter")


def unpermute_qk(w, n_heads: int):
    """The inverse of :func:`permute_qk`: llama.cpp's adjacent-pair rows back to rotate-half."""
    rows = w.shape[0]
    head = rows // n_heads
    if head * n_heads != rows or head % 2:
        raise ConfigError(f"cannot un-permute a {tuple(w.shape)} q/k weight into {n_heads} heads of even size")
    return w.reshape(n_heads, head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensor_name(gguf_name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor; None for one a Hugging Face checkpoint does not
    hold (``rope_freqs``: the importer reads RoPE scaling from it separately)."""
    base, dot, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias") or not dot:
        raise CheckpointError(f"GGUF tensor '{gguf_name}': expected a name ending in .weight or .bias")
    if base == "rope_freqs":
        return None
    if base in _GGUF_TOP:
        return f"{_GGUF_TOP[base]}.{kind}"
    parts = base.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _GGUF_LAYER:
        return f"model.layers.{int(parts[1])}.{_GGUF_LAYER[parts[2]]}.{kind}"
    raise CheckpointError(f"GGUF tensor '{gguf_name}' has no Hugging Face Llama equivalent known to the importer")
