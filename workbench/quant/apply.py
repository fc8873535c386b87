"""Quantization as a transformation of the plain model: ``nn.Linear`` -> :class:`QuantLinear`.

::

    quantize_model(model, QuantRecipe.parse("w4a16:g128"))   # in place; returns the model
    quantization_report(model)      # per layer: bits, granularity (fallbacks named), bytes, error
    weight_bytes(model)             # resident bytes: quantized linears, the rest, total

:class:`QuantLinear` keeps the integer weight, its scales (and zero points) as buffers, and
computes ``x @ dequantize(W)^T`` in the activation's dtype: the torch reference every
low-bit kernel backend is checked against.  The model's ``recipe`` attribute names what was
done (:class:`~workbench.quant.recipe.QuantRecipe`), so results always carry their settings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.errors import ConfigError
from workbench.measure.memory import storage_bytes
from workbench.quant.recipe import QuantRecipe
from workbench.quant.rtn import QuantizedWeight, quantize_weight


class QuantLinear(nn.Module):
    """A linear layer with a quantized weight (buffers: ``qweight``, ``scales``, ``zeros``)."""

    def __init__(self, q: QuantizedWeight, bias: torch.Tensor | None, settings: dict, rel_error: float) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.bits, self.group, self.weight_dtype = q.bits, q.group, q.dtype
        self.register_buffer("qweight", q.qweight)
        self.register_buffer("scales", q.scales)
        self.register_buffer("zeros", q.zeros)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.settings, self.rel_error = settings, rel_error

    @property
    def quantized(self) -> QuantizedWeight:
        return QuantizedWeight(self.qweight, self.scales, self.zeros, self.bits, self.group,
                               (self.out_features, self.in_features), self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.quantized.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        g = f"g{self.group}" if self.group else "per-channel" if self.scales.shape[0] > 1 else "per-tensor"
        return f"in={self.in_features}, out={self.out_features}, w{self.bits}, {g}"


def quantize_model(model: nn.Module, recipe: QuantRecipe | str) -> nn.Module:
    """Replace every ``nn.Linear`` not named in ``recipe.skip`` by a :class:`QuantLinear` (in
    place; returns ``model``, with ``model.recipe`` set).  A model is quantized once."""
    recipe = QuantRecipe.parse(recipe) if isinstance(recipe, str) else recipe
    if getattr(model, "recipe", None) is not None:
        raise ConfigError(f"quantize_model: the model is already quantized ({model.recipe.name}); load it again")
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and not any(s in name.split(".") for s in recipe.skip)]
    if not targets:
        raise ConfigError("quantize_model: no nn.Linear left to quantize after 'skip' "
                          f"({', '.join(recipe.skip)})")
    for name, lin in targets:
        st = recipe.layer_settings(name, lin.in_features)
        w = lin.weight.detach()
        q = quantize_weight(w, bits=st["bits"], group=st["group"], per_channel=st["per_channel"],
                            symmetric=st["symmetric"])
        err = float((q.dequantize(torch.float32) - w.float()).norm() / w.float().norm().clamp_min(1e-30))
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, QuantLinear(q, lin.bias, st, err))
    model.recipe = recipe
    return model


def quantization_report(model: nn.Module) -> list[dict]:
    """One row per quantized layer: name, shape, bits, granularity, fallback, bytes, relative
    weight error ||W_q - W|| / ||W||."""
    rows = []
    for name, mod in model.named_modules():
        if isinstance(mod, QuantLinear):
            st = mod.settings
            gran = f"g{st['group']}" if st["group"] else "per-channel" if st["per_channel"] else "per-tensor"
            rows.append({"layer": name, "in": mod.in_features, "out": mod.out_features, "bits": mod.bits,
                         "granularity": gran, "symmetric": st["symmetric"], "fallback": st["fallback"],
                         "bytes": mod.quantized.nbytes,
                         "dense_bytes_bf16": mod.in_features * mod.out_features * 2, "rel_error": mod.rel_error})
    return rows


def weight_bytes(model: nn.Module) -> dict:
    """Resident bytes of the model's tensors (parameters and buffers, each storage once): the
    quantized linears' (integers, scales, zero points, biases), everything else, the total."""
    seen: set = set()
    own = lambda m: list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))  # noqa: E731
    qmods = [m for m in model.modules() if isinstance(m, QuantLinear)]
    quant = storage_bytes([t for m in qmods for t in own(m)], seen)
    other = storage_bytes([t for m in model.modules() for t in own(m)], seen)   # the rest: seen skips the above
    return {"quantized_linears": quant, "other": other, "total": quant + other}
