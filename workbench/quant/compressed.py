"""Quantized checkpoints in the format vLLM and transformers load: compressed-tensors, ``pack-quantized``
(transformers is checked against it in the tests; vLLM is not run here).

::

    save_compressed(model, "out/", tokenizer_folder=BUNDLED_MODEL)   # a model after quantize_model
    model = load_compressed("out/")          # QuantLinear layers holding the stored integers, model.recipe set
    is_compressed_checkpoint("out/")         # True: config.json declares compressed-tensors
    LLM("out/")                              # the same, through the engine (quant_backend applies)

A folder holds ``config.json`` (the model's config plus ``quantization_config``:
:mod:`workbench.quant.compressed_config`), ``model.safetensors`` (each quantized layer as
``weight_packed`` / ``weight_scale`` / ``weight_shape`` [/ ``weight_zero_point``], laid out as
:mod:`workbench.quant.compressed_layout` describes; the dense tensors as they are), the tokenizer
files, and ``workbench_recipe.json``: our recipe file (:func:`~workbench.quant.recipe.save_recipe`:
the :class:`~workbench.quant.recipe.QuantRecipe`, where its calibration text came from, what
the calibrated methods chose, each layer's weight error), which the format itself has no place
for.  Without it (a checkpoint written by llm-compressor / compressed-tensors) the recipe is
derived from the config groups, method ``rtn``.

Any mix of per-layer settings is written; what vLLM's loader would not take (per-tensor scales,
int8 activations in this format, a fused q/k/v or gate/up with different settings) is listed in
the returned ``notes`` (:func:`~workbench.quant.compressed_config.vllm_notes`).

Integers and scales go both ways bit for bit: nothing is dequantized and quantized again.
Scales are written as float32 whatever ``dtype`` the dense tensors get (vLLM and transformers
cast them to the model's dtype when they load).  Loading checks the config and every header
before any tensor is read, as :func:`workbench.model.loader.load_model` does for dense folders;
every problem is a :class:`~workbench.errors.CheckpointError` naming the file, tensor or field.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from workbench.errors import CheckpointError, ConfigError, WorkbenchError
from workbench.model.checkpoint import (_check_finite, _read_json, check_headers, check_size, checkpoint_files,
                                        expected_shapes, read_safetensors_header, read_tensors, regular_file)
from workbench.model.decoder import CausalLM
from workbench.model.loader import _model_folder, default_dtype, parse_dtype, read_config, resolve_device
from workbench.quant.apply import QuantLinear, set_module
from workbench.quant.compressed_config import (LayerScheme, assign_layers, build_config, check_recipe,
                                               derive_recipe, vllm_notes)
from workbench.quant.compressed_layout import expected_tensors, from_compressed, strategy_of, to_compressed
from workbench.quant.recipe import load_recipe, save_recipe
from workbench.quant.rtn import QuantizedWeight

SIDE_FILE = "workbench_recipe.json"
# Files copied from ``tokenizer_folder`` (those present): the tokenizer and the generation defaults.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
                   "generation_config.json")
_RESERVED = ("format", "version", "name", "recipe")


def is_compressed_checkpoint(folder) -> bool:
    """Whether ``folder``'s config.json declares a compressed-tensors checkpoint (False for
    anything else, including 'bundled', presets and unreadable folders)."""
    path = Path(str(folder)).expanduser() / "config.json"
    try:
        if not path.is_file():
            return False
        raw = _read_json(path, "config.json")
    except (WorkbenchError, OSError):
        return False
    q = raw.get("quantization_config") if isinstance(raw, dict) else None
    return isinstance(q, dict) and q.get("quant_method") == "compressed-tensors"


# ---- writing ------------------------------------------------------------------------------------

def _cpu(q: QuantizedWeight) -> QuantizedWeight:
    return QuantizedWeight(q.qweight.cpu(), q.scales.cpu(), None if q.zeros is None else q.zeros.cpu(), q.bits,
                           q.group, q.shape, q.dtype)


def _check_out_folder(folder: Path) -> None:
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{folder}: exists and is not a folder; give a folder for the checkpoint")
    if folder.is_dir():
        other = sorted(p.name for p in folder.glob("*.safetensors*") if p.name != "model.safetensors")
        if other:
            raise ConfigError(f"{folder}: already holds another checkpoint ({', '.join(other[:3])}); the loader "
                              "would read it too - pick an empty folder")


def save_compressed(model: CausalLM, folder: str | Path, tokenizer_folder: str | Path | None = None,
                    dtype: torch.dtype | str | None = None, extra: dict | None = None) -> dict:
    """Write ``model`` (after :func:`~workbench.quant.apply.quantize_model`, any mix of settings
    per layer) as a compressed-tensors ``pack-quantized`` checkpoint in ``folder``.

    ``dtype``: the dense tensors' dtype (default: as they are in memory); ``tokenizer_folder``:
    where to copy the tokenizer files from; ``extra``: more fields for the recipe side file
    (``"calibration"``: where the calibration text came from, as a recipe file records it).
    Returns what was written: ``{"folder", "groups": {name: {...settings, "layers": [names]}},
    "dense": [names], "dtype", "bytes": {"file", "quantized_linears", "linears_as_dense"},
    "notes": [settings vLLM will not take, see compressed_config.vllm_notes]}``."""
    folder = Path(folder).expanduser()
    quant = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    if any(n.split(".")[-2:-1] == ["lm_head"] for n in quant):
        raise ConfigError("save_compressed: this model's LM head is quantized (a ':head' recipe); compressed-tensors "
                          "checkpoints are written with a dense head here: quantize without ':head' to save one")
    if not quant or getattr(model, "recipe", None) is None:
        raise ConfigError("save_compressed: the model has no quantized layers (quantize_model first; a dense model "
                          "is saved with save_model)")
    extra = dict(extra or {})
    bad = [k for k in extra if k in _RESERVED]
    if bad:
        raise ConfigError(f"save_compressed: extra may not set {bad} (fields of the recipe file itself)")
    dense = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    cfg = model.config
    dt = parse_dtype(dtype) or model.model.embed_tokens.weight.dtype
    _check_out_folder(folder)
    found, src = [], None
    if tokenizer_folder is not None:        # checked before anything is written
        src = Path(tokenizer_folder).expanduser()
        found = [f for f in TOKENIZER_FILES if (src / f).is_file()]
        if not any(f in found for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise ConfigError(f"{src}: no tokenizer files (tokenizer.json, tokenizer.model or vocab.json) to copy")
    schemes = {}
    for name, m in quant.items():
        strategy, group = strategy_of(m.quantized)
        schemes[name] = LayerScheme(m.bits, strategy, group, m.zeros is None, m.act_bits)
    qc, members = build_config(schemes, dense)

    state, qbytes, dense_equiv = {}, 0, 0
    owned = {f"{n}.{b}" for n in quant for b in ("qweight", "scales", "zeros")}
    for k, v in model.state_dict().items():
        if k in owned or (cfg.tie_word_embeddings and k == "lm_head.weight"):
            continue
        t = v.detach().to("cpu")
        state[k] = (t.to(dt) if t.is_floating_point() else t).contiguous()
    for name, m in quant.items():
        for suffix, t in to_compressed(_cpu(m.quantized)).items():
            state[f"{name}.{suffix}"] = t
            qbytes += t.numel() * t.element_size()
        dense_equiv += m.in_features * m.out_features * torch.empty(0, dtype=dt).element_size()

    folder.mkdir(parents=True, exist_ok=True)
    hf = cfg.to_hf()
    hf["torch_dtype"] = str(dt).removeprefix("torch.")
    hf["quantization_config"] = qc
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    for f in found:
        if (src / f).resolve() != (folder / f).resolve():
            shutil.copyfile(src / f, folder / f)
    groups = {g: dict(qc["config_groups"][g]["weights"], act_bits=schemes[names[0]].act_bits, layers=names)
              for g, names in members.items()}
    layers = {n: {"rel_error": m.rel_error, "fallback": m.settings.get("fallback")} for n, m in quant.items()}
    save_recipe(folder / SIDE_FILE, model.recipe, calibration=extra.pop("calibration", None),
                checkpoint={"format": "compressed-tensors", "compression": "pack-quantized",
                            "groups": {g: v["layers"] for g, v in groups.items()}},
                quant_calibration=getattr(model, "quant_calibration", None), layers=layers, **extra)
    return {"folder": str(folder), "groups": groups, "dense": dense, "dtype": hf["torch_dtype"],
            "bytes": {"file": (folder / "model.safetensors").stat().st_size, "quantized_linears": qbytes,
                      "linears_as_dense": dense_equiv}, "notes": vllm_notes(schemes, dense)}


# ---- reading ------------------------------------------------------------------------------------

def _modules(cfg) -> tuple[dict[str, str], dict[str, tuple[int, int]]]:
    """From the config alone: ``{module: class}`` of the embedding and every linear layer (the
    LM head included, tied or not), and ``{linear: (out, in)}``."""
    shapes = {}
    for name, (shape, _) in expected_shapes(cfg).items():
        if name.endswith(".weight") and len(shape) == 2 and name != "model.embed_tokens.weight":
            shapes[name.removesuffix(".weight")] = shape
    shapes.setdefault("lm_head", (cfg.vocab_size, cfg.hidden_size))
    return {"model.embed_tokens": "Embedding", **{n: "Linear" for n in shapes}}, shapes


def _describe(s: LayerScheme) -> str:
    g = f"g{s.group}" if s.group else s.strategy
    return f"w{s.bits}a{s.act_bits or 16} {g} {'sym' if s.symmetric else 'asym'}"


def _check_layer_headers(folder: Path, name: str, s: LayerScheme, out: int, inp: int,
                         where: dict[str, Path], headers: dict[Path, dict]) -> tuple[str, ...]:
    """The stored tensors of one quantized layer against what its config group implies."""
    group = f"config group {s.group_name!r} ({_describe(s)})"
    if s.group and inp % s.group:
        raise CheckpointError(f"{folder / 'config.json'}: {group} has group_size {s.group}, which does not divide "
                              f"the input width {inp} of '{name}'")
    if s.bits == 4 and inp % 2:
        raise CheckpointError(f"{folder / 'config.json'}: '{name}' has an odd input width {inp}; int4 values are "
                              "held two per byte here")
    exp = expected_tensors(out, inp, s.bits, s.strategy, s.group, s.symmetric)
    for suffix, (shapes, dtypes) in exp.items():
        full = f"{name}.{suffix}"
        path = where.get(full)
        if path is None:
            raise CheckpointError(f"{folder}: tensor '{full}' is missing: {group} quantizes '{name}', stored as "
                                  + ", ".join(f"{name}.{x}" for x in exp))
        info = headers[path][full]
        if info["dtype"] not in dtypes:
            raise CheckpointError(f"{path}: tensor '{full}' has dtype {info['dtype']}; pack-quantized stores it as "
                                  f"{' or '.join(dtypes)}")
        if tuple(info["shape"]) not in shapes:
            raise CheckpointError(f"{path}: tensor '{full}' has shape {tuple(info['shape'])}, expected "
                                  f"{' or '.join(str(x) for x in shapes)} for '{name}' [{out}, {inp}] in {group}")
    for full, path in where.items():
        if (full.startswith(name + ".") and full[len(name) + 1:] not in exp
                and full[len(name) + 1:] not in ("bias", "weight")):
            what = full[len(name) + 1:]
            why = ("activation reordering (actorder 'group', g_idx) is not run here" if what == "weight_g_idx" else
                   "static activation scales are not run here (only dynamic int8 per token)"
                   if what.startswith("input_")
                   else f"'{what}' is not part of {_describe(s)} pack-quantized")
            raise CheckpointError(f"{path}: tensor '{full}': {why}")
    return tuple(f"{name}.{x}" for x in exp)


def _layer_errors(doc: dict | None, side: Path) -> dict[str, float]:
    """``{layer: rel_error}`` from the recipe file's ``layers`` (what the writer measured; a layer
    without one has none).  A ``layers`` that is no object, or an error that is no number, is a
    CheckpointError naming the field: the file was not written by save_compressed."""
    layers = (doc or {}).get("layers")
    if layers is None:
        return {}
    if not isinstance(layers, dict):
        raise CheckpointError(f"{side}: field 'layers' must be an object of layer name -> "
                              f"{{rel_error, fallback}}, got {type(layers).__name__}")
    out = {}
    for name, entry in layers.items():
        rel = entry.get("rel_error") if isinstance(entry, dict) else None
        if rel is not None and (isinstance(rel, bool) or not isinstance(rel, (int, float)) or not math.isfinite(rel)):
            raise CheckpointError(f"{side}: field 'layers' entry {name!r:.80}: 'rel_error' must be a finite number "
                                  f"or null, got {rel!r:.80}")
        out[name] = rel
    return out


def load_compressed(folder: str | Path, device: str | torch.device | None = None,
                    dtype: str | torch.dtype | None = None, check_finite: bool = True) -> CausalLM:
    """Read a compressed-tensors ``pack-quantized`` checkpoint (ours or one compressed-tensors /
    llm-compressor wrote) into a :class:`CausalLM` whose quantized layers are
    :class:`~workbench.quant.apply.QuantLinear` holding the stored integers; ``model.recipe``
    is the equivalent recipe.  ``device`` / ``dtype`` as :func:`~workbench.model.loader.load_model`
    (``dtype``: the dense weights and the activations; scales stay float32).  The layers compute
    with the reference until :func:`~workbench.quant.apply.set_quant_backend` (``LLM`` calls it)."""
    folder = _model_folder(str(folder))
    config_path = folder / "config.json"
    cfg = read_config(folder)
    qc = cfg.extra.get("quantization_config")
    if not isinstance(qc, dict):
        raise CheckpointError(f"{config_path}: no 'quantization_config' object: not a compressed-tensors checkpoint "
                              "(a dense folder loads with load_model)")
    modules, shapes = _modules(cfg)
    assigned = assign_layers(qc, modules, f"{config_path}: quantization_config")
    layers = {n: s for n, s in assigned.items() if s is not None}
    dense = [n for n in shapes if assigned.get(n) is None]
    if not layers:
        raise CheckpointError(f"{config_path}: quantization_config quantizes no linear layer of this model "
                              "(every one is ignored or matches no target)")
    files = checkpoint_files(folder)
    headers = {p: read_safetensors_header(p) for p in files}
    check_size(cfg, files, folder)
    where: dict[str, Path] = {}
    for path, header in headers.items():
        for name in header:
            if name in where:
                raise CheckpointError(f"{path}: tensor '{name}' is also in {where[name]}; a tensor must be stored once")
            where[name] = path
    for name in dense:
        for suffix in ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape"):
            if f"{name}.{suffix}" in where:
                raise CheckpointError(f"{where[f'{name}.{suffix}']}: tensor '{name}.{suffix}' is stored, but "
                                      f"{config_path}'s quantization_config leaves '{name}' dense (in 'ignore' or "
                                      "matched by no target)")
    replaced = {f"{n}.weight": _check_layer_headers(folder, n, s, *shapes[n], where, headers)
                for n, s in layers.items()}
    plan = check_headers(cfg, headers, folder, replaced)       # the dense tensors: names, shapes, float dtypes
    side = folder / SIDE_FILE
    doc = None
    in_features = {n: shapes[n][1] for n in layers}
    if side.exists() or side.is_symlink():
        regular_file(side, "recipe file")          # a FIFO or folder so named is refused unopened
        recipe, doc = load_recipe(side)
        check_recipe(recipe, layers, dense, in_features, str(side))
    else:
        recipe = derive_recipe(layers, dense, in_features)
        check_recipe(recipe, layers, dense, in_features, f"{config_path} (derived recipe)")

    state = read_tensors(plan)
    packed = read_tensors({t: where[t] for names in replaced.values() for t in names})
    if check_finite:
        _check_finite(state, plan)
    for n in layers:
        got = packed[f"{n}.weight_shape"].tolist()
        if got != list(shapes[n]):
            raise CheckpointError(f"{where[n + '.weight_shape']}: tensor '{n}.weight_shape' holds {got}, expected "
                                  f"{list(shapes[n])} from config.json")
        sc = packed[f"{n}.weight_scale"]
        if check_finite and not torch.isfinite(sc).all():
            raise CheckpointError(f"{where[n + '.weight_scale']}: tensor '{n}.weight_scale' holds NaN / Inf scales")

    dev = resolve_device(device)
    dt = parse_dtype(dtype) or default_dtype(dev, cfg.torch_dtype)
    with torch.device("meta"):
        model = CausalLM(cfg)
    for n in layers:                     # placeholders: no meta weight to move, scales keep float32 below
        set_module(model, n, nn.Identity())
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(device=dev, dtype=dt)
    errors = _layer_errors(doc, side)
    for n, s in layers.items():
        out, inp = shapes[n]
        t = {k.removeprefix(n + "."): v for k, v in packed.items() if k.startswith(n + ".")}
        q = from_compressed(t, out, inp, s.bits, s.strategy, s.group, dt)
        q = QuantizedWeight(q.qweight.to(dev), q.scales.to(dev), None if q.zeros is None else q.zeros.to(dev),
                            q.bits, q.group, q.shape, dt)
        bias = state.get(f"{n}.bias")
        rel = errors.get(n)
        set_module(model, n, QuantLinear(q, None if bias is None else bias.to(dev, dt),
                                         recipe.layer_settings(n, inp), rel))
    left = [k for k, v in list(model.named_parameters()) + list(model.named_buffers()) if v.is_meta]
    if left:
        raise CheckpointError(f"{folder}: no values for {', '.join(left[:5])} after loading")
    model.recipe = recipe
    model.quant_calibration = (doc or {}).get("quant_calibration")
    model.quant_checkpoint = {"folder": str(folder), "recipe_file": str(side) if doc else None,
                              "groups": sorted({s.group_name for s in layers.values()}),
                              "method_recorded": doc is not None}
    return model.eval()
