"""Per-layer sensitivity: quantize one layer at a time, everything else unquantized, and measure
how much worse the model gets.

::

    targets = linear_targets(model)                                   # the layers a recipe may quantize
    rows = layer_sensitivity(model, ref, {"w4a16:g128": QuantRecipe.parse("w4a16:g128")}, targets)
    rows[0]      # {"layer", "kind", "block", "option", "ppl": (delta, se), "kl": ..., "top1": ..., ...}

Each row is one measurement (:func:`workbench.quant.quality.measure`) of the model with exactly
one layer quantized under one option, against the unquantized reference on the same tokens.  A
round-to-nearest option swaps the layer in place (the same :func:`~workbench.quant.apply.
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

from workbench.quant.quality import Reference, measure
from workbench.quant.recipe import QuantRecipe


def linear_targets(model: nn.Module, recipe: QuantRecipe | None = None) -> list[str]:
    """The ``nn.Linear`` layers a recipe quantizes (not in its ``skip``; default: all but the
    embedding and the LM head), in module order."""
    recipe = recipe or QuantRecipe()
    return [n for n, m in model.named_modules() if isinstance(m, nn.Linear) and not recipe.skips(n)]


def layer_kind(name: str) -> tuple[int | None, str]:
    """``("model.layers.3.mlp.down_proj")`` -> ``(3, "down_proj")``."""
    m = re.search(r"\.(\d+)\.", name)
    return (int(m.group(1)) if m else None), name.rsplit(".", 1)[-1]


def only_layer(recipe: QuantRecipe, layer: str, targets: list[str]) -> QuantRecipe:
    """``recipe`` restricted to ``layer``: every other target joins ``skip``."""
    return dataclasses.replace(recipe, skip=tuple(recipe.skip) + tuple(t for t in targets if t != layer))


def _measure_one(model: nn.Module, ref: Reference, layer: str, recipe: QuantRecipe, targets: list[str],
                 calibration, backend: str) -> dict:
    from workbench.quant.apply import quantize_model, set_quant_backend

    if recipe.needs_calibration:
        m = copy.deepcopy(model)
        quantize_model(m, only_layer(recipe, layer, targets), calibration=calibration)
        set_quant_backend(m, backend)
        return measure(m, ref)
    from workbench.quant.costs import build_option
    from workbench.quant.apply import set_module

    lin = model.get_submodule(layer)
    old = set_module(model, layer, build_option(lin, layer, recipe, backend))
    try:
        return measure(model, ref)
    finally:
        set_module(model, layer, old)


def layer_sensitivity(model: nn.Module, ref: Reference, options: dict, targets: list[str] | None = None,
                      calibration=None, backend: str = "auto", progress=None) -> list[dict]:
    """One row per (layer, option) of ``options`` (name -> QuantRecipe): the degradation of every
    metric with only that layer quantized, with its paired standard error."""
    targets = linear_targets(model) if targets is None else list(targets)
    rows = []
    for i, layer in enumerate(targets):
        block, kind = layer_kind(layer)
        for opt, recipe in options.items():
            if recipe is None:
                continue
            if progress:
                progress(f"sensitivity {i + 1}/{len(targets)}: {layer} {opt}")
            t0 = time.perf_counter()
            r = _measure_one(model, ref, layer, recipe, targets, calibration, backend)
            rows.append({"layer": layer, "block": block, "kind": kind, "option": opt,
                         **{k: tuple(v) for k, v in r["degradation"].items()},
                         "agreement": r["agreement"], "seconds": time.perf_counter() - t0})
    return rows
