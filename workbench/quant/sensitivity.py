"""Per-layer sensitivity: quantize one layer (or one fused group of layers) at a time, everything
else unquantized, and measure how much worse the model gets.

::

    targets = linear_targets(model)                                   # the layers a recipe may quantize
    units = layer_units(targets)                                      # q/k/v and gate/up of a block tied
    rows = layer_sensitivity(model, ref, {"w4a16:g128": QuantRecipe.parse("w4a16:g128")}, targets, units=units)
    rows[0]      # {"layer" (the unit), "layers", "kind", "block", "option", "ppl": (delta, se), "kl": ..., ...}

Each row is one measurement (:func:`workbench.quant.quality.measure`) of the model with exactly
one *unit* quantized under one option - a layer, or the layers an engine fuses into one matmul
(q/k/v, gate/up: :func:`layer_units`) - against the unquantized reference on the same tokens.  A
round-to-nearest option swaps the layers in place (the same :func:`~workbench.quant.apply.
quantize_linear` that :func:`~workbench.quant.apply.quantize_model` calls) and puts the float
layer back; AWQ, GPTQ and SmoothQuant options calibrate, so each of those runs
:func:`~workbench.quant.apply.quantize_model` on a copy of the model with every other layer in
``skip``.  Single-layer deltas are small, often below their paired standard error; the search
(:mod:`workbench.quant.search`) adds them up as a *prediction* and then measures every mix it
proposes, so a wrong prediction costs a measurement, never a wrong report.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import time

from torch import nn

from workbench.errors import ConfigError
from workbench.quant.quality import Reference, measure
from workbench.quant.recipe import QuantRecipe
from workbench.quant.apply import quantize_model, set_module, set_quant_backend, target_names
from workbench.quant.costs import build_option


def linear_targets(model: nn.Module, recipe: QuantRecipe | None = None) -> list[str]:
    """The ``nn.Linear`` layers a recipe quantizes (not in its ``skip``; default: all but the
    embedding and the LM head), in module order."""
    return target_names(model, recipe or QuantRecipe())


def layer_kind(name: str) -> tuple[int | None, str]:
    """``("model.layers.3.mlp.down_proj")`` -> ``(3, "down_proj")``."""
    m = re.search(r"\.(\d+)\.", name)
    return (int(m.group(1)) if m else None), name.rsplit(".", 1)[-1]


# the layers an inference engine fuses into one matmul (one input, one set of weights side by side):
# vLLM, TensorRT-LLM and SGLang run q/k/v as one qkv_proj and gate/up as one gate_up_proj, with
# one quantization scheme for the fused weight
FUSED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
         "up_proj": "gate_up_proj"}


UNIT_KINDS = ("layer", "block")


def layer_units(targets: list[str], tie_fused: bool = True, unit: str = "layer") -> dict[str, list[str]]:
    """The units a precision is chosen for: unit name -> its layers, in module order.  With
    ``tie_fused`` the layers an engine fuses (``FUSED``: q/k/v, gate/up of one block) are one
    unit (``model.layers.3.self_attn.qkv_proj``), so a mix stays loadable where they are one
    matmul; every other layer is its own unit.  ``unit="block"``: every linear of one decoder
    block is one unit (``model.layers.3``; a layer outside the blocks, e.g. the LM head, stays
    its own): 7x fewer sensitivity measurements, a coarser mix - the first pass on a large model."""
    if unit not in UNIT_KINDS:
        raise ConfigError(f"calibrate: unit must be one of {', '.join(UNIT_KINDS)}, got {unit!r}")
    units: dict[str, list[str]] = {}
    for t in targets:
        parent, _, kind = t.rpartition(".")
        block = re.match(r"(.*\.layers\.\d+)\.", t) if unit == "block" else None
        key = block.group(1) if block else f"{parent}.{FUSED[kind]}" if tie_fused and kind in FUSED else t
        units.setdefault(key, []).append(t)
    return units


def only_layers(recipe: QuantRecipe, layers: list[str], targets: list[str]) -> QuantRecipe:
    """``recipe`` restricted to ``layers``: every other target joins ``skip``."""
    keep = set(layers)
    return dataclasses.replace(recipe, skip=tuple(recipe.skip) + tuple(t for t in targets if t not in keep))


def _measure_unit(model: nn.Module, ref: Reference, layers: list[str], recipe: QuantRecipe, targets: list[str],
                  calibration, backend: str) -> dict:
    if recipe.needs_calibration:
        m = copy.deepcopy(model)
        quantize_model(m, only_layers(recipe, layers, targets), calibration=calibration)
        set_quant_backend(m, backend)
        return measure(m, ref)
    old = {n: set_module(model, n, build_option(model.get_submodule(n), n, recipe, backend)) for n in layers}
    try:
        return measure(model, ref)
    finally:
        for n, mod in old.items():
            set_module(model, n, mod)


def layer_sensitivity(model: nn.Module, ref: Reference, options: dict, targets: list[str] | None = None,
                      calibration=None, backend: str = "auto", units: dict[str, list[str]] | None = None,
                      progress=None) -> list[dict]:
    """One row per (unit, option) of ``options`` (name -> QuantRecipe; None = dense, skipped):
    the degradation of every metric with only that unit's layers quantized, with its paired
    standard error.  ``units`` (default: each target alone; see :func:`layer_units`)."""
    targets = linear_targets(model) if targets is None else list(targets)
    units = units or {t: [t] for t in targets}
    rows = []
    for i, (unit, layers) in enumerate(units.items()):
        block, kind = layer_kind(unit)
        for opt, recipe in options.items():
            if recipe is None:
                continue
            if progress:
                progress(f"sensitivity {i + 1}/{len(units)}: {unit} {opt}")
            t0 = time.perf_counter()
            r = _measure_unit(model, ref, layers, recipe, targets, calibration, backend)
            rows.append({"layer": unit, "layers": list(layers), "block": block, "kind": kind, "option": opt,
                         **{k: tuple(v) for k, v in r["degradation"].items()},
                         "agreement": r["agreement"], "seconds": time.perf_counter() - t0})
    return rows
