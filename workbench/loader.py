"""Load a model from a Hugging Face–format folder, the bundled model, or a shape preset.

Safetensors only: a ``.bin`` / ``.pt`` checkpoint is refused, never unpickled.  Before any
tensor is read, every file's header is parsed and checked against the file size, so a
truncated download is reported as such (file, tensor, byte offsets) rather than as a crash
deep inside a read.  Every tensor's name and shape is checked against the config.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from .config import ModelConfig
from .errors import CheckpointError, ConfigError
from .model import CausalLM, init_weights
from .presets import PRESETS, preset_config

BUNDLED_MODEL = Path(__file__).resolve().parent.parent / "data" / "reference-model"

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
_ST_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U64": 8,
                "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
# Buffers some exporters write that are recomputed here.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return _DTYPES[str(dtype).removeprefix("torch.")]
    except KeyError:
        raise ConfigError(f"dtype {dtype!r} is not supported; use one of float32, float16, bfloat16") from None


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None or device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {str(device)!r} requested but CUDA is not available on this machine; "
                          "use device='cpu'")
    return dev


def default_dtype(device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """float32 on CPU (bf16 matmuls are slow there); the checkpoint's dtype on a GPU."""
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(str(checkpoint_dtype), torch.bfloat16) if checkpoint_dtype != "float32" else torch.float32


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: config.json not found; a Hugging Face–format model folder "
                              "needs config.json and *.safetensors")
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object of config fields, got {type(raw).__name__}")
    return ModelConfig.from_hf(raw, source=str(path))


def read_safetensors_header(path: Path) -> dict[str, dict]:
    """Parse and check one safetensors header: ``{name: {dtype, shape, data_offsets}}``."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: file is {size} bytes, too short for a safetensors header "
                                  "(truncated download?)")
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise CheckpointError(f"{path}: header claims {n} bytes but the file has only {size} bytes "
                                  "(truncated download?)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: safetensors header is not valid JSON (corrupt file?)") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: safetensors header is not a JSON object (corrupt file?)")
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = info["dtype"], list(info["shape"]), info["data_offsets"]
            ok = (isinstance(dtype, str) and all(type(d) is int and d >= 0 for d in shape)
                  and type(begin) is int and type(end) is int and 0 <= begin <= end)
        except (TypeError, KeyError, ValueError):
            ok = False
        if not ok:
            raise CheckpointError(f"{path}: safetensors header entry for tensor '{name}' is malformed "
                                  f"(expected dtype, shape and data_offsets [begin, end]; got {info!r})")
        if end > data_size:
            raise CheckpointError(f"{path}: tensor '{name}' ends at data byte {end} but the file holds only "
                                  f"{data_size} data bytes (truncated download?)")
        itemsize = _ST_ITEMSIZE.get(dtype)
        if itemsize is not None and end - begin != math.prod(shape) * itemsize:
            raise CheckpointError(f"{path}: tensor '{name}' ({dtype}, shape {tuple(shape)}) needs "
                                  f"{math.prod(shape) * itemsize} bytes but its data_offsets span {end - begin} "
                                  "(corrupt file?)")
    return header


def checkpoint_files(folder: Path) -> list[Path]:
    """The safetensors files of a folder: from ``model.safetensors.index.json`` or by glob."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e!r})") from None
        files = sorted({folder / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{index}: lists shard '{f.name}' which is missing from {folder}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in folder.glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt"))
        hint = (f" (found {', '.join(pickled)}: pickled checkpoints are never loaded; convert them to "
                "safetensors first)") if pickled else ""
        raise CheckpointError(f"{folder}: no *.safetensors weights found{hint}")
    return files


def load_state_dict(folder: Path, model: CausalLM) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = model.config.tie_word_embeddings
    if tied:
        expected.pop("lm_head.weight", None)
    state: dict[str, torch.Tensor] = {}
    where: dict[str, Path] = {}
    for path in checkpoint_files(folder):
        header = read_safetensors_header(path)
        for name, info in header.items():
            if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
                continue
            if name not in expected:
                raise CheckpointError(f"{path}: unexpected tensor '{name}' for a "
                                      f"{model.config.architecture} with this config.json")
            if tuple(info["shape"]) != expected[name]:
                raise CheckpointError(f"{path}: tensor '{name}' has shape {tuple(info['shape'])}, expected "
                                      f"{expected[name]} from config.json")
            if info["dtype"] not in _ST_DTYPES:
                raise CheckpointError(f"{path}: tensor '{name}' has dtype {info['dtype']}; expected a float type")
            where[name] = path
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    if name in where and where[name] == path:
                        state[name] = f.get_tensor(name)
        except Exception as e:  # SafetensorError and friends: name the file, not a Rust error
            raise CheckpointError(f"{path}: cannot read safetensors file ({type(e).__name__}: {e})") from None
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (f" and {len(missing) - 5} more" if len(missing) > 5 else "")
        raise CheckpointError(f"{folder}: tensor(s) missing from the checkpoint: {shown}")
    return state


def model_config(path_or_preset: str | Path | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a folder, preset or the bundled model, without reading weights."""
    spec = str(path_or_preset) if path_or_preset is not None else "bundled"
    if spec.startswith("preset:"):
        return preset_config(spec.removeprefix("preset:"))
    return read_config(_model_folder(spec))


def _model_folder(spec: str) -> Path:
    folder = BUNDLED_MODEL if spec == "bundled" else Path(spec).expanduser()
    if not folder.exists():
        raise CheckpointError(f"{folder}: model folder not found (give a Hugging Face–format folder, "
                              f"'bundled', or one of: {', '.join('preset:' + p for p in PRESETS)})")
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: expected a model folder, got a file")
    return folder


def load_model(path_or_preset: str | Path | None = None, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None, seed: int = 0) -> CausalLM:
    """Load a model for inference (``eval()`` mode, no grad needed).

    ``path_or_preset``: a Hugging Face–format folder, ``"preset:<name>"`` for random weights
    with a known model's shapes (see :data:`workbench.presets.PRESETS`), or None / "bundled"
    for the bundled reference model.  ``device`` defaults to CUDA when available; ``dtype``
    defaults to float32 on CPU and the checkpoint's dtype on a GPU.
    """
    dev = resolve_device(device)
    want = parse_dtype(dtype)
    spec = str(path_or_preset) if path_or_preset is not None else "bundled"
    if spec.startswith("preset:"):
        cfg = preset_config(spec.removeprefix("preset:"))
        dt = want or default_dtype(dev, cfg.torch_dtype)
        with torch.device("meta"):
            model = CausalLM(cfg)
        model = model.to_empty(device=dev).to(dt)
        if cfg.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        return init_weights(model, seed=seed).eval()
    folder = _model_folder(spec)
    cfg = read_config(folder)
    dt = want or default_dtype(dev, cfg.torch_dtype)
    with torch.device("meta"):
        model = CausalLM(cfg)
    state = load_state_dict(folder, model)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device=dev, dtype=dt).eval()


def save_model(model: CausalLM, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (tied weights stored once)."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cfg = model.config
    state = {k: v.detach().to("cpu", dtype or v.dtype).contiguous() for k, v in model.state_dict().items()
             if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    hf = cfg.to_hf()
    if dtype is not None:
        hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
