"""GGUF export for llama.cpp: a Hugging Face–format Llama-family folder as one GGUF file.

:func:`export_gguf` writes config.json + *.safetensors + tokenizer.json of a Llama, Mistral or
Qwen2 model with the light, pure-Python ``gguf`` package (``pip install gguf``), imported only
when called.  The llama.cpp measurement that uses it is :mod:`workbench.bench.llamacpp`.

Conversion notes (what llama.cpp's own ``convert_hf_to_gguf.py`` does for these models):

* Weights keep their ``(out, in)`` row-major layout; GGUF stores dimensions reversed, so a
  Hugging Face ``[out, in]`` matrix is exactly ggml's ``ne = [in, out]``.
* RoPE: Hugging Face Llama checkpoints rotate the two *halves* of each head (``rotate_half``),
  while llama.cpp's ``llama`` architecture rotates adjacent *pairs*.  ``q_proj`` / ``k_proj``
  rows are therefore permuted within each head so that row ``2j`` / ``2j+1`` hold what were
  rows ``j`` / ``j + d/2`` (:func:`permute_qk`).  Qwen2 is written as llama.cpp's ``qwen2``
  architecture, which rotates halves like Hugging Face, so it is not permuted.
* 1-D tensors (norms, biases) stay float32 whatever ``dtype`` says, as llama.cpp expects.
* Tied embeddings: no ``output.weight`` is written; llama.cpp then reuses ``token_embd``.
* Llama-3 RoPE scaling becomes a ``rope_freqs.weight`` tensor of per-frequency divisors.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from workbench.errors import CheckpointError, ConfigError, TokenizerError, WorkbenchError
from workbench.model.gguf_names import _ARCHS, _LAYER_NAMES, gguf_tensor_name, permute_qk  # noqa: F401 - re-exported

# Bump when the exported file would differ (cache keys include it).
EXPORT_FORMAT_VERSION = 1

_GGUF_DTYPES = ("f32", "f16", "bf16", "q8_0")   # q8_0: the gguf package's port of ggml's reference quantizer
_GGUF_HINT = "the `gguf` package is needed to write GGUF files: pip install gguf"

# ---- optional import ---------------------------------------------------------------------------

def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise WorkbenchError(_GGUF_HINT) from None
    return gguf


# ---- conversion helpers ----------------------------------------------------------------------

def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    return data if isinstance(data, dict) else {}


def _first_id(value) -> int | None:
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None


def _pre_tokenizer_name(tok: dict) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a byte-level BPE tokenizer.json (it only
    matters when llama.cpp tokenizes text; the benchmark feeds token ids)."""
    pre = tok.get("pre_tokenizer") or {}
    items = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    patterns = [str((p.get("pattern") or {}).get("Regex", "")) for p in items if p.get("type") == "Split"]
    if not patterns:
        return "gpt-2"     # plain ByteLevel(use_regex=True): GPT-2's split
    pattern = patterns[0]
    if "\\p{N}{1,3}" in pattern:
        return "llama-bpe"  # Llama 3
    if "\\p{N}|" in pattern or pattern.endswith("\\p{N}"):
        return "qwen2"
    return "default"


def _vocab_metadata(folder: Path, vocab_size: int, cfg) -> dict[str, Any]:
    """Tokenizer fields of a GGUF file from ``tokenizer.json`` (+ tokenizer_config.json)."""
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"{path}: tokenizer.json not found; llama.cpp needs the vocabulary in the GGUF file")
    tok = _read_json(path)
    model = tok.get("model") or {}
    if model.get("type") != "BPE":
        raise TokenizerError(f"{path}: tokenizer model type {model.get('type')!r} is not supported "
                             "(BPE only: byte-level like GPT-2 / Llama 3, or SentencePiece-style with byte fallback)")
    vocab: dict[str, int] = model.get("vocab") or {}
    added = {int(t["id"]): t for t in tok.get("added_tokens") or []}
    n = max([vocab_size, *(i + 1 for i in vocab.values()), *(i + 1 for i in added)])
    if n > vocab_size:
        raise TokenizerError(f"{path}: the tokenizer has ids up to {n - 1} but config.json vocab_size is "
                             f"{vocab_size}")
    tokens: list[str | None] = [None] * n
    for text, i in vocab.items():
        tokens[i] = text
    for i, t in added.items():
        tokens[i] = t["content"]

    raw_merges = model.get("merges") or []
    merges = [m if isinstance(m, str) else " ".join(m) for m in raw_merges]
    spm = bool(model.get("byte_fallback"))     # SentencePiece-style BPE (Llama 2, Mistral v0.1)
    gguf = _import_gguf()
    TT = gguf.TokenType
    types, scores = [], []
    rank = {m.replace(" ", "", 1): r for r, m in enumerate(merges)}   # merged token -> merge rank
    for i, text in enumerate(tokens):
        if text is None:                     # padding up to config.json's vocab_size
            tokens[i] = f"[PAD{i}]"
            types.append(TT.UNUSED)
        elif i in added:
            types.append(TT.CONTROL if added[i].get("special") else TT.USER_DEFINED)
        elif spm and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
            types.append(TT.BYTE)
        else:
            types.append(TT.NORMAL)
        # SentencePiece merges the highest-scoring pair first: score = -merge rank
        scores.append(-float(rank.get(tokens[i], 0)) if i not in added else 0.0)

    tcfg = _read_json(folder / "tokenizer_config.json")
    gcfg = _read_json(folder / "generation_config.json")

    def special(name: str) -> int | None:
        for source in (gcfg, {f"{name}_token_id": getattr(cfg, f"{name}_token_id", None)}):
            tid = _first_id(source.get(f"{name}_token_id"))
            if tid is not None:
                return tid
        text = tcfg.get(f"{name}_token")
        text = text.get("content") if isinstance(text, dict) else text
        return tokens.index(text) if isinstance(text, str) and text in tokens else None

    meta: dict[str, Any] = {
        "model": "llama" if spm else "gpt2",
        "pre": None if spm else _pre_tokenizer_name(tok),
        "tokens": tokens, "types": [int(t) for t in types],
        "scores": scores if spm else None, "merges": None if spm else merges,
        "bos": special("bos"), "eos": special("eos"), "pad": special("pad"),
        "add_bos": bool(tcfg.get("add_bos_token", spm)), "add_eos": bool(tcfg.get("add_eos_token", False)),
    }
    unk = model.get("unk_token")
    if unk is not None and unk in tokens:
        meta["unk"] = tokens.index(unk)
        meta["types"][meta["unk"]] = int(TT.UNKNOWN)
    if tcfg.get("chat_template") and isinstance(tcfg["chat_template"], str):
        meta["chat_template"] = tcfg["chat_template"]
    return meta


def _rope_freq_factors(cfg):
    """llama.cpp's ``rope_freqs`` for Llama-3 scaling: the divisor of each base frequency."""
    from workbench.model.decoder import rope_inv_freq

    base = rope_inv_freq(cfg.head_dim, cfg.rope_theta, None)
    scaled = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    return (base / scaled).float().numpy()


def _to_numpy(t, dtype: str, gguf):
    """(array, raw_dtype) for GGUFWriter.add_tensor: 1-D tensors always float32."""
    import torch

    arr = t.to(torch.float32).numpy()
    if arr.ndim <= 1 or dtype == "f32":
        return arr, None
    if dtype == "f16":
        return arr.astype("float16"), None
    qtype = gguf.GGMLQuantizationType.Q8_0 if dtype == "q8_0" else gguf.GGMLQuantizationType.BF16
    return gguf.quants.quantize(arr, qtype), qtype


# ---- export ----------------------------------------------------------------------------------

def _add_model_metadata(writer, gguf, name: str, cfg, dtype: str) -> None:
    """The GGUF header's model keys: name, file type, the shapes llama.cpp builds the graph from, RoPE
    (with linear scaling) and the norm's epsilon."""
    writer.add_name(name)
    writer.add_file_type({"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
                          "bf16": gguf.LlamaFileType.MOSTLY_BF16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[dtype])
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(float(cfg.rms_norm_eps))
    writer.add_vocab_size(cfg.vocab_size)
    if cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(cfg.rope_scaling["factor"]))


def _add_tokenizer_metadata(writer, vocab: dict) -> None:
    """The GGUF header's tokenizer keys (:func:`_vocab_metadata`): the model, its tokens, types,
    scores and merges, the special token ids and the chat template."""
    writer.add_tokenizer_model(vocab["model"])
    if vocab["pre"]:
        writer.add_tokenizer_pre(vocab["pre"])
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["types"])
    if vocab["scores"] is not None:
        writer.add_token_scores(vocab["scores"])
    if vocab["merges"] is not None:
        writer.add_token_merges(vocab["merges"])
    for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                     ("pad", writer.add_pad_token_id), ("unk", writer.add_unk_token_id)):
        if vocab.get(key) is not None:
            add(vocab[key])
    writer.add_add_bos_token(vocab["add_bos"])
    writer.add_add_eos_token(vocab["add_eos"])
    if "chat_template" in vocab:
        writer.add_chat_template(vocab["chat_template"])


def _add_tensors(writer, gguf, folder: Path, cfg, permute: bool, dtype: str) -> None:
    """Every checkpoint tensor under its llama.cpp name (Q and K permuted for llama.cpp's RoPE where
    the architecture needs it, matrices in ``dtype``), and Llama-3's ``rope_freqs``; a CheckpointError
    names the tensors llama.cpp needs that the checkpoint lacks."""
    from safetensors import safe_open

    from workbench.model.loader import checkpoint_files

    if cfg.rope_scaling and cfg.rope_scaling["rope_type"] == "llama3":
        writer.add_tensor("rope_freqs.weight", _rope_freq_factors(cfg))
    heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}
    seen = set()
    for file in checkpoint_files(folder):
        with safe_open(str(file), framework="pt") as f:
            for hf_name in f.keys():
                name = gguf_tensor_name(hf_name)
                if name is None:
                    continue
                if name == "output.weight" and cfg.tie_word_embeddings:
                    continue            # llama.cpp falls back to token_embd
                t = f.get_tensor(hf_name)
                kind = name.split(".")[-2]
                if permute and kind in heads:
                    t = permute_qk(t, heads[kind])
                arr, raw = _to_numpy(t, dtype, gguf)
                if raw is None:
                    writer.add_tensor(name, arr)
                else:       # the bytes' shape (a Q8_0 row is blocks of 34 bytes); the writer derives the float one
                    writer.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=raw)
                seen.add(name)
    expected = {"token_embd.weight", "output_norm.weight"}
    for i in range(cfg.num_hidden_layers):
        expected |= {f"blk.{i}.{n}.weight" for n in _LAYER_NAMES.values()}
    missing = sorted(expected - seen, key=lambda s: (len(s), s))
    if missing:
        raise CheckpointError(f"{folder}: checkpoint lacks tensors llama.cpp needs: {', '.join(missing[:4])}"
                              + (" ..." if len(missing) > 4 else ""))


def export_gguf(model_dir: str | os.PathLike, out_path: str | os.PathLike, dtype: str = "f32") -> Path:
    """Write ``model_dir`` (config.json + *.safetensors + tokenizer.json of a Llama, Mistral or
    Qwen2 model) as a GGUF file at ``out_path``; ``dtype`` is f32, f16, bf16 or q8_0 for the matrices.

    The file is written next to ``out_path`` and renamed into place, so an interrupted export
    never leaves a truncated file behind.  Returns ``out_path``.
    """
    from workbench.model.loader import read_config

    if dtype not in _GGUF_DTYPES:
        raise ConfigError(f"export_gguf: dtype {dtype!r} is not supported; use one of {', '.join(_GGUF_DTYPES)}")
    gguf = _import_gguf()
    folder = Path(model_dir).expanduser()
    out = Path(out_path).expanduser()
    cfg = read_config(folder)
    arch, permute = _ARCHS[cfg.architecture]
    if cfg.o_bias or cfg.mlp_bias:
        raise ConfigError(f"{folder}: o_proj / MLP biases are not supported by this GGUF exporter")
    vocab = _vocab_metadata(folder, cfg.vocab_size, cfg)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    writer = gguf.GGUFWriter(str(tmp), arch)
    try:
        _add_model_metadata(writer, gguf, folder.name, cfg, dtype)
        _add_tokenizer_metadata(writer, vocab)
        _add_tensors(writer, gguf, folder, cfg, permute, dtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.replace(tmp, out)
    except BaseException:
        writer.close()
        tmp.unlink(missing_ok=True)
        raise
    return out
