"""Quantization as a transformation of the plain model: ``nn.Linear`` -> :class:`QuantLinear`.

::

    quantize_model(model, QuantRecipe.parse("w4a16:g128"))   # in place; returns the model
    quantize_model(model, "w4a16:g128:awq", calibration=seqs)  # AWQ / GPTQ / SmoothQuant read token sequences
    quantization_report(model)      # per layer: bits, granularity (fallbacks named), bytes, error
    weight_bytes(model)             # resident bytes: quantized linears, the rest, total

:class:`QuantLinear` keeps the integer weight, its scales (and zero points) as buffers, and
computes ``x @ dequantize(W)^T`` in the activation's dtype: the torch reference every
low-bit kernel backend is checked against.  With int8 activations (W4A8 / W8A8) the input is
first rounded per token, ``x -> round(x / s_t) * s_t`` with ``s_t = max|x_t| / 127``: the same
numbers an integer kernel multiplies, in floating point.  With bf16 / fp16 activations the
dequantized weight is rounded to that dtype before the matmul (a kernel that keeps it in fp32
registers differs from this reference by that rounding, ~0.5-1.5% relative on logits).  The
model's ``recipe`` attribute names what was done (:class:`~workbench.quant.recipe.QuantRecipe`),
so results always carry their settings.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from workbench.errors import ConfigError, WorkbenchError
from workbench.measure.memory import storage_bytes
from workbench.quant.recipe import QuantRecipe, name_matches
from workbench.quant.rtn import QuantizedWeight, pack_int4, quantize_weight
from workbench.quant import cpu_ops, kernel_ops
from workbench.quant.awq import awq_search
from workbench.quant.calib import collect_linear_inputs
from workbench.quant.cpu_ops import int4pack_values
from workbench.quant.hooks import check_settings
from workbench.quant.smooth import smooth_model


class QuantLinear(nn.Module):
    """A linear layer with a quantized weight (buffers: ``qweight``, ``scales``, ``zeros``)."""

    def __init__(self, q: QuantizedWeight, bias: torch.Tensor | None, settings: dict, rel_error: float) -> None:
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.bits, self.group, self.weight_dtype = q.bits, q.group, q.dtype
        self.act_bits = settings.get("act_bits")
        self.register_buffer("qweight", q.qweight)
        self.register_buffer("scales", q.scales)
        self.register_buffer("zeros", q.zeros)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)
        self.settings, self.rel_error = settings, rel_error

    qweight_layout = "rows"      # or cpu_ops.INT4PACK_LAYOUT: the int4 CPU op's layout (one copy, its own)

    @property
    def quantized(self) -> QuantizedWeight:
        """The stored weight in the row layout (rebuilt from the int4 CPU op's layout when that op
        holds it)."""
        qweight = self.qweight
        if self.qweight_layout != "rows":
            qweight = pack_int4(int4pack_values(qweight, self.out_features, self.in_features))
        return QuantizedWeight(qweight, self.scales, self.zeros, self.bits, self.group,
                               (self.out_features, self.in_features), self.weight_dtype)

    def use_row_layout(self) -> None:
        """Give the buffers back the row layout (before another backend packs them)."""
        if self.qweight_layout != "rows":
            q = self.quantized
            self.qweight, self.scales, self.qweight_layout = q.qweight, q.scales.contiguous(), "rows"

    backend = "reference"        # set_quant_backend: "reference" | "cpu" | "triton"
    _op = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reference_forward(x) if self._op is None else self._op(x)

    def reference_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act_bits:
            x = fake_quantize_per_token(x)
        return F.linear(x, self.quantized.dequantize(x.dtype), self.bias)

    def extra_repr(self) -> str:
        g = f"g{self.group}" if self.group else "per-channel" if self.scales.shape[0] > 1 else "per-tensor"
        return (f"in={self.in_features}, out={self.out_features}, w{self.bits}a{self.act_bits or 16}, {g}, "
                f"{self.backend}")


class QuantHead(nn.Linear):
    """The LM head computing from a quantized copy of its weight (``q``, a :class:`QuantLinear`).

    The float ``weight`` stays, the same Parameter as before: a tied head *is* the embedding, whose
    rows the model looks up, and the engine reads the head's device and dtype from it.  What a decode
    step reads is the copy: at W8A8 a quarter of the float bytes, which for a small model with a large
    vocabulary is most of a step (SmolLM2-135M: 28 M of its 135 M parameters are the tied head).
    Resident bytes grow by the copy (the float weight is needed for the embedding anyway)."""

    def __init__(self, lin: nn.Linear, q: QuantLinear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = lin.in_features, lin.out_features
        self.weight, self.bias = lin.weight, lin.bias          # the same Parameters: a tie stays a tie
        self.q = q

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.q(x)


def fake_quantize_per_token(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """``x`` rounded to a symmetric int grid with one scale per row (token): ``s = max|x| / 127``
    (at least 1e-12 / 127), ``round(x / s).clamp(-127, 127) * s``, in x's dtype (computed in fp32)."""
    hi = (1 << (bits - 1)) - 1
    xf = x.float()
    s = xf.abs().amax(-1, keepdim=True).clamp_min(1e-12) / hi
    return (torch.round(xf / s).clamp(-hi, hi) * s).to(x.dtype)


def quantize_model(model: nn.Module, recipe: QuantRecipe | str, calibration=None, *,
                   group_scales=None, pack=None) -> nn.Module:
    """Replace every ``nn.Linear`` not named in ``recipe.skip`` by a :class:`QuantLinear` (in
    place; returns ``model``, with ``model.recipe`` set).  A model is quantized once.

    ``calibration``: token-id sequences, required by AWQ, GPTQ and SmoothQuant (the benchmarks
    use the calibration half of the held-out corpus, disjoint from the evaluation half).  What
    the calibrated methods chose is kept in ``model.quant_calibration``.

    ``group_scales`` / ``pack``: your functions in place of the package's scales and zero points
    (asymmetric int4) and nibble packing, for round-to-nearest int4 recipes
    (:mod:`workbench.quant.hooks`: what they take and return, and the checks of what they
    return).  The layers are replaced only once every one of them was quantized."""
    recipe = QuantRecipe.parse(recipe) if isinstance(recipe, str) else recipe
    if getattr(model, "recipe", None) is not None:
        raise ConfigError(f"quantize_model: the model is already quantized ({model.recipe.name}); load it again")
    _check_names(model, recipe)
    targets = [(name, model.get_submodule(name)) for name in target_names(model, recipe)]
    heads = [(n, m) for n, m in targets if n.split(".")[-1] == "lm_head"]
    if heads and (recipe.method != "rtn" or recipe.smooth is not None):
        raise ConfigError(f"quantize_model: the LM head is quantized round-to-nearest only ({recipe.name} "
                          "calibrates on its layers' inputs); keep 'lm_head' in the recipe's skip, or use rtn")
    targets = [(n, m) for n, m in targets if (n, m) not in heads]
    if not targets:
        raise ConfigError("quantize_model: no nn.Linear left to quantize after 'skip' "
                          f"({', '.join(recipe.skip)})")
    hooks = {"group_scales": group_scales, "pack": pack}
    if group_scales is not None or pack is not None:
        check_settings([(n, recipe.layer_settings(n, m.in_features)) for n, m in targets + heads], group_scales, pack)
    calib = _calibrate(model, recipe, calibration, [n for n, _ in targets])
    done, head_names = [], {n for n, _ in heads}
    for name, lin in targets + heads:
        try:
            q = quantize_linear(lin, recipe.layer_settings(name, lin.in_features), weight=calib["weights"].get(name),
                                clip=calib["clip"].get(name), **hooks)
        except WorkbenchError as e:
            if group_scales is None and pack is None:
                raise
            raise WorkbenchError(f"layer {name}: {e}") from None    # the model is still as it was: nothing replaced yet
        # the head keeps its float weight (the embedding's): QuantHead
        done.append((name, QuantHead(lin, q) if name in head_names else q))
    for name, mod in done:
        set_module(model, name, mod)
    model.recipe = recipe
    model.quant_calibration = calib["report"]
    return model


def target_names(model: nn.Module, recipe: QuantRecipe) -> list[str]:
    """The layers :func:`quantize_model` quantizes: every ``nn.Linear`` that no entry of
    ``recipe.skip`` names (:meth:`QuantRecipe.skips`), in module order."""
    return [n for n, m in model.named_modules()
            if isinstance(m, nn.Linear) and not isinstance(m, QuantHead) and not recipe.skips(n)]


def _check_names(model: nn.Module, recipe: QuantRecipe) -> None:
    """Every ``skip`` entry beyond the defaults and every ``overrides`` entry must name a linear
    layer of ``model``: one that names none was made for another model (or is a typo), and
    ignoring it would quantize the layer it meant to protect."""
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    default = QuantRecipe().skip
    unmatched = [("skip", e) for e in recipe.skip if e not in default and not any(name_matches(n, e) for n in linears)]
    unmatched += [("overrides", e) for e, _ in recipe.overrides if not any(name_matches(n, e) for n in linears)]
    if unmatched:
        where, entry = unmatched[0]
        raise ConfigError(f"quantize_model: recipe field {where!r} names {entry!r}, which is no linear layer of this "
                          f"model ({len(unmatched)} such entr{'y' if len(unmatched) == 1 else 'ies'}; e.g. "
                          f"{linears[0] if linears else '-'}): was the recipe made for another model?")


def quantize_linear(lin: nn.Linear, settings: dict, weight: QuantizedWeight | None = None,
                    clip: torch.Tensor | None = None, *, group_scales=None, pack=None) -> QuantLinear:
    """One ``nn.Linear`` as a :class:`QuantLinear` with ``settings`` (``recipe.layer_settings``):
    round-to-nearest (scales times ``clip``, AWQ's multipliers), or ``weight`` as GPTQ stored it;
    ``group_scales`` / ``pack``: see :func:`quantize_model`."""
    w = lin.weight.detach()
    q = weight if weight is not None else quantize_weight(
        w, bits=settings["bits"], group=settings["group"], per_channel=settings["per_channel"],
        symmetric=settings["symmetric"], scale_multiplier=clip, group_scales=group_scales, pack=pack)
    err = float((q.dequantize(torch.float32) - w.float()).norm() / w.float().norm().clamp_min(1e-30))
    return QuantLinear(q, lin.bias, settings, err)


def set_module(model: nn.Module, name: str, module: nn.Module) -> nn.Module:
    """Put ``module`` at the dotted ``name`` of ``model``; returns the module it replaced."""
    parent_name, _, child = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    old = getattr(parent, child)
    setattr(parent, child, module)
    return old


def _calibrate(model: nn.Module, recipe: QuantRecipe, calibration, names: list[str]) -> dict:
    """SmoothQuant, then AWQ or GPTQ, as the recipe asks: folded scales change the model's
    float weights in place; returns the clip multipliers (AWQ), the finished weights (GPTQ)
    and what each step chose."""
    out = {"clip": {}, "weights": {}, "report": None}
    if not recipe.needs_calibration:
        return out
    seqs = [list(s) for s in (calibration or [])]
    if not seqs:
        raise ConfigError(f"quantize_model: {recipe.name} reads activations; pass calibration=[token id lists] "
                          "(e.g. heldout_split(tokenizer)['calibration'])")
    report = {"sequences": len(seqs), "tokens": sum(len(s) for s in seqs)}
    if recipe.smooth is not None:
        # every input, skipped layers' too
        report["smooth"] = smooth_model(model, collect_linear_inputs(model, seqs), recipe.smooth)
    if recipe.method == "awq":
        res = awq_search(model, recipe, seqs)
        out["clip"], report["awq"] = res.clip, res.report
    elif recipe.method == "gptq":
        from workbench.quant.gptq import gptq_quantize  # lazy: gptq imports this module (a cycle)

        res = gptq_quantize(model, recipe, seqs)
        out["weights"], report["gptq"] = res.weights, res.report
    out["report"] = report
    return out


BACKENDS = ("auto", "reference", "cpu", "triton")


def set_quant_backend(model: nn.Module, backend: str = "auto") -> dict:
    """Choose how every :class:`QuantLinear` computes: ``reference`` (dequantize, then
    ``F.linear``: the definition), ``cpu`` (torch's packed CPU ops,
    :mod:`workbench.quant.cpu_ops`), ``triton`` (the fused kernels of
    ``workbench_kernels.quant_matmul``), or ``auto`` (``cpu`` on a CPU, ``triton`` on a GPU).
    A layer whose format the backend cannot run keeps the reference (an explicit ``cpu`` /
    ``triton`` that runs no layer at all is a ConfigError), and the returned summary
    says how many layers run where and why: ``{"backend": b, "layers": {backend: n}, "fallbacks":
    {reason: n}, "extra_bytes": n}`` - ``extra_bytes``: what the ops keep beside the stored
    weights (torch's int4 CPU op holds the weight in its own layout, the layer's only copy,
    and its own scales-and-zeros)."""
    if backend not in BACKENDS:
        raise ConfigError(f"quant backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    if getattr(model, "_wb_stream", None) is not None:     # its ops would repack whatever a buffer holds now
        raise ConfigError("set_quant_backend: this model streams its weights; choose the backend before "
                          "stream_weights (or remove() the streamer first)")

    layers: dict[str, int] = {}
    fallbacks: dict[str, int] = {}
    extra = 0
    for mod in model.modules():
        if not isinstance(mod, QuantLinear):
            continue
        mod.use_row_layout()
        want = backend if backend != "auto" else ("cpu" if mod.qweight.device.type == "cpu" else "triton")
        op, why = None, None
        if want == "cpu":
            op, why = cpu_ops.cpu_op(mod), cpu_ops.cpu_op_reason(mod)
        elif want == "triton":
            op, why = kernel_ops.kernel_op(mod), kernel_ops.kernel_op_reason(mod)
        mod._op = op
        extra += getattr(op, "extra_bytes", 0)
        mod.backend = want if op is not None else "reference"
        layers[mod.backend] = layers.get(mod.backend, 0) + 1
        if op is None and want != "reference":
            fallbacks[why] = fallbacks.get(why, 0) + 1
    if backend in ("cpu", "triton") and backend not in layers:
        raise ConfigError(f"quant backend {backend!r} runs none of the {sum(layers.values())} quantized layers: "
                          + "; ".join(f"{why} ({n} layers)" for why, n in fallbacks.items())
                          + " (use 'auto' to take what this machine has)")
    model.quant_backend = {"backend": backend, "layers": layers, "fallbacks": fallbacks, "extra_bytes": extra}
    return model.quant_backend


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
                         "bytes": mod.quantized.nbytes, "act_bits": mod.act_bits, "backend": mod.backend,
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
