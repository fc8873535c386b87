"""Per-input-channel scales folded into the plain model, its function unchanged: the common
step of AWQ and SmoothQuant.

::

    groups = scale_groups(model)           # ScaleGroup per (op -> linears reading its output)
    fold_scales(model, groups[0], s)        # s [in] > 0: the linears' input becomes X / s, their weights W * s
    skipped_groups(model)                   # pairs that cannot be folded, with the reason

A *scale group* is an operation ``prev`` whose output feeds the linears ``layers`` and nothing
else, so that for a positive vector ``s`` over that shared input, ``prev``'s output divided by
``s`` and every consumer's weight columns multiplied by ``s`` compute the same function::

    (X / s) (W diag(s))^T = X W^T                      (a bias of the consumer is unchanged)

The groups of a Llama-family decoder layer (:mod:`workbench.model.decoder`):

============================  ====================  =============================================
``prev``                      ``layers``            how ``prev`` divides its output by ``s``
============================  ====================  =============================================
``input_layernorm``           q, k, v               RMSNorm ``y = x / rms(x) * w``: ``w / s``
``post_attention_layernorm``  gate, up              ``w / s``
``mlp.up_proj``               down                  up's rows (and bias) ``/ s``: down's input is
                                                    ``silu(gate(x)) * up(x)``, linear in up's output
``self_attn.v_proj``          o                     v's rows (and bias) ``/ s``: o's input is the
                                                    attention-weighted sum of v, channel for channel
============================  ====================  =============================================

v -> o only when o's input width equals v's output width: with grouped-query attention
(``num_key_value_heads < num_attention_heads``) each v channel feeds several o columns, one
per query head of its group, and that pair is left out (:func:`skipped_groups` names it;
AWQ then gives o_proj a clipping search only).  The final norm, the embedding and the LM head
are never touched (the embedding may be tied to the LM head).

The norm's formula matters: :class:`~workbench.model.decoder.RMSNorm` multiplies by ``weight``
(Llama, Qwen2, Mistral), so ``weight / s`` is exact.  A ``(1 + weight)`` norm (Gemma) would need
``(1 + w) / s - 1``; such a model is refused rather than folded wrongly.  Folding computes in
float32 and writes back in the parameter's dtype (exact up to that dtype's rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workbench.errors import ConfigError
from workbench.model.decoder import RMSNorm


@dataclass(frozen=True)
class ScaleGroup:
    """``prev`` (a norm or a linear, by module name) feeds ``layers`` (linear names); ``kind``:
    ``attn_in`` / ``mlp_in`` / ``mlp_down`` / ``attn_out``; ``layer``: the decoder layer index."""

    prev: str
    layers: tuple[str, ...]
    kind: str
    layer: int

    @property
    def prev_is_norm(self) -> bool:
        return self.kind in ("attn_in", "mlp_in")


def _decoder_layers(model: nn.Module):
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ConfigError("scale_groups: expected a Llama-family CausalLM (model.model.layers[i] with "
                          "input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, "
                          "mlp.{gate,up,down}_proj)")
    return layers


def scale_groups(model: nn.Module) -> list[ScaleGroup]:
    """The foldable groups of every decoder layer, in layer order (attn_in, attn_out when
    foldable, mlp_in, mlp_down)."""
    out = []
    for i, layer in enumerate(_decoder_layers(model)):
        p = f"model.layers.{i}"
        at = layer.self_attn
        out.append(ScaleGroup(f"{p}.input_layernorm", (f"{p}.self_attn.q_proj", f"{p}.self_attn.k_proj",
                                                        f"{p}.self_attn.v_proj"), "attn_in", i))
        if at.o_proj.in_features == at.v_proj.out_features:
            out.append(ScaleGroup(f"{p}.self_attn.v_proj", (f"{p}.self_attn.o_proj",), "attn_out", i))
        out.append(ScaleGroup(f"{p}.post_attention_layernorm", (f"{p}.mlp.gate_proj", f"{p}.mlp.up_proj"),
                              "mlp_in", i))
        out.append(ScaleGroup(f"{p}.mlp.up_proj", (f"{p}.mlp.down_proj",), "mlp_down", i))
    return out


def skipped_groups(model: nn.Module) -> list[dict]:
    """The v -> o pairs that cannot be folded (grouped-query attention), with the reason."""
    out = []
    for i, layer in enumerate(_decoder_layers(model)):
        at = layer.self_attn
        if at.o_proj.in_features != at.v_proj.out_features:
            p = f"model.layers.{i}.self_attn"
            out.append({"prev": f"{p}.v_proj", "layers": [f"{p}.o_proj"], "kind": "attn_out", "layer": i,
                        "skipped": f"grouped-query attention: o_proj reads {at.o_proj.in_features} channels, "
                                   f"v_proj writes {at.v_proj.out_features} (each v channel feeds "
                                   f"{at.o_proj.in_features // max(at.v_proj.out_features, 1)} o columns); "
                                   "no scale folded, o_proj gets the clipping search only"})
    return out


def group_width(model: nn.Module, group: ScaleGroup) -> int:
    """Width of the group's shared input (the length of its scale vector)."""
    return model.get_submodule(group.layers[0]).in_features


@torch.no_grad()
def fold_scales(model: nn.Module, group: ScaleGroup, s: torch.Tensor) -> None:
    """In place: ``prev``'s output divided by ``s`` and the consumers' weight columns multiplied
    by ``s`` (``s``: ``[in]``, positive and finite); the model's function is unchanged."""
    prev = model.get_submodule(group.prev)
    lins = [model.get_submodule(n) for n in group.layers]
    for n, m in zip(group.layers, lins):
        if type(m) is not nn.Linear:
            raise ConfigError(f"fold_scales: {n} is a {type(m).__name__}, not a plain nn.Linear "
                              "(scales are folded into the float model before quantizing)")
    width = lins[0].in_features
    s = s.detach().float().reshape(-1)
    if s.numel() != width or any(m.in_features != width for m in lins):
        raise ConfigError(f"fold_scales: group {group.prev} -> {', '.join(group.layers)} reads {width} channels, "
                          f"got a scale of {s.numel()}")
    if not bool(torch.isfinite(s).all()) or bool((s <= 0).any()):
        raise ConfigError(f"fold_scales: scales for {group.prev} must be positive and finite")
    if group.prev_is_norm:
        if not isinstance(prev, RMSNorm):
            raise ConfigError(f"fold_scales: {group.prev} is a {type(prev).__name__}; only the decoder's RMSNorm "
                              "(y = x / rms(x) * weight) is folded")
        w = prev.weight
        w.copy_((w.float() / s.to(w.device)).to(w.dtype))
    else:
        if type(prev) is not nn.Linear or prev.out_features != width:
            raise ConfigError(f"fold_scales: {group.prev} must be a plain nn.Linear with {width} outputs")
        w = prev.weight
        w.copy_((w.float() / s.to(w.device)[:, None]).to(w.dtype))
        if prev.bias is not None:
            prev.bias.copy_((prev.bias.float() / s.to(w.device)).to(prev.bias.dtype))
    for m in lins:
        m.weight.copy_((m.weight.float() * s.to(m.weight.device)[None, :]).to(m.weight.dtype))
