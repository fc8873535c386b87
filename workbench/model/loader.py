"""Load a model from a Hugging Face–format folder, the bundled model, or a shape preset.

Safetensors only: a ``.bin`` / ``.pt`` checkpoint is refused, never unpickled.  The loader
checks before it allocates, in this order:

1. ``config.json``: every field's type and bounds (:class:`~workbench.model.config.ModelConfig`; a
   million layers or ``hidden_size: 2**40`` fails in microseconds);
2. the weight files: regular files only (a directory or FIFO named ``*.safetensors`` is refused
   before it is opened); every header (JSON only, no tensor data) against its file's size (a
   truncated download is named as such) and for known dtypes;
3. the parameter count the config implies must fit in the bytes the files hold, then every
   tensor's name and shape in the headers must match the config, naming the config field that
   disagrees (layers, hidden / intermediate sizes, heads, head_dim, vocab);
4. only then is the model built (on the meta device) and the tensors read; one cheap pass
   refuses NaN / Inf weights (``check_finite=False`` opts out).

Presets (random weights, no files) get the config checks only.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from workbench.model.checkpoint import (_check_finite, _read_json, check_headers, check_quantization, check_size,
                                        checkpoint_files, read_tensors)
from workbench.model.checkpoint import expected_shapes, read_safetensors_header, regular_file  # noqa: F401 - also loader's API
from workbench.model.config import ModelConfig
from workbench.errors import CheckpointError, ConfigError
from workbench.model.decoder import CausalLM, init_weights
from workbench.model.presets import PRESETS, preset_config

BUNDLED_MODEL = Path(__file__).resolve().parents[2] / "data" / "reference-model"

_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
           "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


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
    name = str(checkpoint_dtype).removeprefix("torch.")
    if name in ("float32", "fp32", "float", "float64", "double"):
        return torch.float32
    return _DTYPES.get(name, torch.bfloat16)


def read_config(folder: Path) -> ModelConfig:
    path = folder / "config.json"
    if not os.path.lexists(path):
        raise CheckpointError(f"{path}: config.json not found; a Hugging Face–format model folder "
                              "needs config.json and *.safetensors")
    raw = _read_json(path, "config.json")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object of config fields, got {type(raw).__name__}")
    return ModelConfig.from_hf(raw, source=str(path))


def load_state_dict(folder: Path, model: CausalLM) -> dict[str, torch.Tensor]:
    """The checked tensors of ``folder`` for ``model`` (headers checked before any data is read)."""
    files = checkpoint_files(folder)
    plan = check_headers(model.config, {p: read_safetensors_header(p) for p in files}, folder)
    return read_tensors(plan)


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
        kind = "a file" if folder.is_file() else "not a folder"
        raise CheckpointError(f"{folder}: expected a model folder, got {kind}")
    return folder


def load_model(path_or_preset: str | Path | None = None, device: str | torch.device | None = None,
               dtype: str | torch.dtype | None = None, seed: int = 0, check_finite: bool = True) -> CausalLM:
    """Load a model for inference (``eval()`` mode, no grad needed).

    ``path_or_preset``: a Hugging Face–format folder, ``"preset:<name>"`` for random weights
    with a known model's shapes (see :data:`workbench.model.presets.PRESETS`), or None / "bundled"
    for the bundled reference model.  ``device`` defaults to CUDA when available; ``dtype``
    defaults to float32 on CPU and the checkpoint's dtype on a GPU.  ``check_finite``: refuse
    a checkpoint holding NaN / Inf weights (one pass over the tensors; False skips it).

    The config and every file header are checked before the model is built or any tensor is
    read (see the module docstring); every problem is a :class:`~workbench.errors.WorkbenchError`.
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
    cfg = read_config(folder)                       # types and bounds of every field
    check_quantization(cfg, folder)
    files = checkpoint_files(folder)                # regular files only, never opened otherwise
    headers = {p: read_safetensors_header(p) for p in files}   # headers only: truncation, dtypes
    check_size(cfg, files, folder)                  # the parameters must fit in the files' bytes
    plan = check_headers(cfg, headers, folder)      # names and shapes against the config fields
    dt = want or default_dtype(dev, cfg.torch_dtype)
    state = read_tensors(plan)
    if check_finite:
        _check_finite(state, plan)
    with torch.device("meta"):
        model = CausalLM(cfg)
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.to(device=dev, dtype=dt).eval()


def save_model(model: CausalLM, folder: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (tied weights stored once)."""
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
