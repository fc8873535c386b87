"""Outliers: which input channels set the quantizers' ranges, and what each scheme does to them.

::

    stats = collect_linear_inputs(model, calibration, keep_rows=256)   # workbench.quant.calib
    labels, m = activation_map(stats, "down_proj")      # [layers, in] per-channel max |x|
    labels, w = weight_map(model, "down_proj")          # [layers, in] per-column max |W[:, j]|
    range_setters(stats, top=8)                          # per layer: max/median, top channels, range share
    recurring_channels(stats, "q_proj", top=8)           # channel -> in how many layers' top-8
    scheme_errors(w, x_rows)                             # output error per granularity, outliers vs rest
    compare_stats(before, after, "q_proj")               # max/median before and after SmoothQuant / AWQ

Kinds name the linear layers by what they read (``y = x W^T``, ``W [out, in]``; the input
channel ``j`` is column ``j`` of ``W``):

* ``q_proj`` - the attention input (the normed residual stream; ``k_proj`` / ``v_proj`` read the
  same tensor), ``gate_proj`` - the MLP input (``up_proj`` reads the same), both ``hidden_size``
  wide: the residual stream's outlier dimensions show up here, in the same channels layer after layer;
* ``o_proj`` - the attention output (heads concatenated), ``down_proj`` - the MLP hidden
  activation ``silu(gate) * up`` (``intermediate_size`` wide).

Every number is computed from the statistics of :mod:`workbench.quant.calib` (the calibration
half of the held-out corpus) or from plain tensors; nothing here changes a model.  Ratios are
``max / median`` of the per-channel ``max|x_j|`` (1 for a flat channel profile; the larger,
the more of a per-tensor or per-token int8 grid a few channels use up).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable

import torch
from torch import nn

from workbench.errors import ConfigError
from workbench.quant.apply import fake_quantize_per_token
from workbench.quant.recipe import QuantRecipe
from workbench.quant.rtn import quantize_weight

KINDS = {"q_proj": "attention input (q/k/v)", "o_proj": "attention output",
         "gate_proj": "MLP input (gate/up)", "down_proj": "MLP hidden (silu(gate) * up)"}

# (label, recipe spec): what scheme_errors compares by default.  g128 on a layer whose width is
# not a multiple of 128 gets the recipe's fallback (the bundled down_proj: 704 -> g64), named
# in the row's ``granularity`` / ``fallback``.
DEFAULT_SCHEMES = (
    ("W4 per-tensor", "w4a16:pt"),
    ("W4 per-channel", "w4a16:pc"),
    ("W4 g128", "w4a16:g128"),
    ("W4 g64", "w4a16:g64"),
    ("W4 g32", "w4a16:g32"),
    ("W8 per-channel", "w8a16:pc"),
    ("W8A8 (per-token A8, per-channel W8)", "w8a8:pc"),
)

_LAYER = re.compile(r"layers\.(\d+)\.")


def _layer_index(name: str) -> int:
    m = _LAYER.search(name)
    return int(m.group(1)) if m else -1


def _of_kind(names, kind: str) -> list[str]:
    """The names ending in ``.kind`` (or equal to it), in layer order."""
    out = sorted((n for n in names if n == kind or n.endswith("." + kind)), key=lambda n: (_layer_index(n), n))
    if not out:
        raise ConfigError(f"no linear layer of kind {kind!r} (expected a suffix such as "
                          f"{', '.join(KINDS)})")
    return out


def _label(name: str) -> str:
    i = _layer_index(name)
    return f"L{i}" if i >= 0 else name


def _ratio(a: torch.Tensor) -> float:
    """max / median of a per-channel magnitude vector (inf if the median is 0)."""
    a = a.double()
    med = float(a.median())
    return float(a.max()) / med if med > 0 else math.inf


def activation_map(stats: dict, kind: str) -> tuple[list[str], torch.Tensor]:
    """Per-channel ``max|x_j|`` of the inputs of every layer of ``kind`` (``"q_proj"``,
    ``"o_proj"``, ``"gate_proj"``, ``"down_proj"``, or any other linear's suffix), from
    :func:`~workbench.quant.calib.collect_linear_inputs` statistics: (labels ``["L0", ...]``,
    float32 ``[n_layers, in]``)."""
    names = _of_kind(stats, kind)
    return [_label(n) for n in names], torch.stack([stats[n].absmax.float().cpu() for n in names])


def _weight(mod: nn.Module) -> torch.Tensor:
    """The weight a linear computes with: a QuantLinear's dequantized weight (float32), else ``.weight``."""
    q = getattr(mod, "quantized", None)
    if q is not None:
        return q.dequantize(torch.float32)
    return mod.weight.detach().float()


def weight_map(model: nn.Module, kind: str) -> tuple[list[str], torch.Tensor]:
    """Per input channel ``max_i |W[i, j]|`` of every linear of ``kind`` (a QuantLinear's
    dequantized weight: what it multiplies with): (labels, float32 ``[n_layers, in]``)."""
    mods = {n: m for n, m in model.named_modules() if hasattr(m, "in_features") and hasattr(m, "out_features")}
    names = _of_kind(mods, kind)
    return [_label(n) for n in names], torch.stack([_weight(mods[n]).abs().amax(0).cpu() for n in names])


def _top(absmax: torch.Tensor, top: int) -> torch.Tensor:
    return absmax.float().topk(min(top, absmax.numel())).indices


def recurring_channels(stats: dict, kind: str, top: int = 8) -> list[tuple[int, int]]:
    """``[(channel, layers), ...]``: every input channel among the ``top`` largest ``max|x_j|`` of
    at least one layer of ``kind``, with the number of layers in whose top it is; most
    frequent first (ties: lower channel first).  Meaningful where the layers read the same
    coordinates (``q_proj`` / ``gate_proj``: the residual stream), not across heads or MLP units
    of different layers."""
    count: dict[int, int] = {}
    for n in _of_kind(stats, kind):
        for c in _top(stats[n].absmax, top).tolist():
            count[c] = count.get(c, 0) + 1
    return sorted(count.items(), key=lambda kv: (-kv[1], kv[0]))


def range_setters(stats: dict, top: int = 8, kinds=None) -> list[dict]:
    """One row per layer (``kinds``: the kinds to include, default every linear in ``stats``): which
    input channels set the range.

    * ``layer``, ``kind``, ``in`` - the module name, its suffix, its input width;
    * ``absmax`` - ``max_j max|x_j|``, the per-tensor activation range; ``median`` - the median
      over channels of ``max|x_j|``; ``max_median`` - their ratio;
    * ``top_channels`` / ``top_absmax`` - the ``top`` channels with the largest ``max|x_j|`` and
      those values (descending);
    * ``range_share`` - ``absmax / max over the other channels``: how many times larger the
      per-tensor int8 scale is because of the top channels (1: they do not set the range);
    * ``token_range_share`` - with sampled rows (``keep_rows > 0``): the median over tokens of
      ``max_j |x_tj| / max_(j not top) |x_tj|``, the same for a per-token scale (what W8A8 uses),
      and ``token_top_fraction`` - the fraction of tokens whose largest ``|x_tj|`` is in a top
      channel (the tokens whose int8 scale those channels set); both None without rows;
    * ``recurring`` - how many of the top channels are in the top of at least half (and at least
      two) of the layers of the same kind in ``stats`` (:func:`recurring_channels`);
      ``layers_of_kind`` - how many such layers there are.
    """
    names = list(stats)
    if kinds is not None:
        names = [n for k in kinds for n in _of_kind(stats, k)]
    by_kind: dict[str, list[str]] = {}
    for n in names:
        by_kind.setdefault(n.rsplit(".", 1)[-1], []).append(n)
    frequent = {}
    for k, ns in by_kind.items():
        c = recurring_channels({n: stats[n] for n in ns}, k, top)
        frequent[k] = {ch for ch, cnt in c if cnt >= max(2, math.ceil(len(ns) / 2))}
    rows = []
    for n in names:
        s, kind = stats[n], n.rsplit(".", 1)[-1]
        a = s.absmax.double().cpu()
        idx = _top(a, top)
        rest = torch.ones_like(a, dtype=torch.bool)
        rest[idx] = False
        mx = float(a.max())
        other = float(a[rest].max()) if rest.any() else 0.0
        tok = tok_top = None
        if s.rows is not None and s.rows.numel() and rest.any():
            r = s.rows.double().abs().cpu()
            per_tok, per_tok_rest = r.amax(1), r[:, rest].amax(1)
            ok = per_tok_rest > 0
            tok = float((per_tok[ok] / per_tok_rest[ok]).median()) if ok.any() else None
            tok_top = float((~rest[r.argmax(1)]).double().mean())
        rows.append({"layer": n, "kind": kind, "in": a.numel(), "absmax": mx, "median": float(a.median()),
                     "max_median": _ratio(a), "top_channels": idx.tolist(), "top_absmax": a[idx].tolist(),
                     "range_share": mx / other if other > 0 else math.inf, "token_range_share": tok,
                     "token_top_fraction": tok_top,
                     "recurring": sum(c in frequent[kind] for c in idx.tolist()),
                     "layers_of_kind": len(by_kind[kind])})
    return rows


# ---- what a quantization scheme does to the output -------------------------------------------------
def _scheme(spec, in_features: int) -> tuple[str, Callable, Callable | None, dict]:
    """(label, weight fn, activation fn or None, settings) from a recipe string, a (label, recipe
    string) pair or a (label, weight fn[, activation fn]) tuple."""
    if isinstance(spec, str):
        spec = (spec, spec)
    label, what, *act = spec
    if isinstance(what, (str, QuantRecipe)):
        r = QuantRecipe.parse(what) if isinstance(what, str) else what
        st = r.layer_settings("", in_features)

        def wfn(w, st=st):
            return quantize_weight(w, bits=st["bits"], group=st["group"], per_channel=st["per_channel"],
                                   symmetric=st["symmetric"]).dequantize(torch.float32)

        afn = (lambda x, b=st["act_bits"]: fake_quantize_per_token(x, b)) if st["act_bits"] else None
        gran = f"g{st['group']}" if st["group"] else "per-channel" if st["per_channel"] else "per-tensor"
        return str(label), wfn, afn, {"granularity": gran, "fallback": st["fallback"], "bits": st["bits"],
                                      "act_bits": st["act_bits"]}
    if not callable(what):
        raise ConfigError(f"scheme_errors: a scheme is a recipe string, (label, recipe) or "
                          f"(label, weight fn[, activation fn]); got {spec!r}")
    return str(label), what, (act[0] if act else None), {}


@torch.no_grad()
def scheme_errors(w: torch.Tensor, x_rows: torch.Tensor, schemes=DEFAULT_SCHEMES, outliers=None,
                  top: int = 8) -> list[dict]:
    """The output error of each scheme on real inputs, split by input channel.

    ``w`` ``[out, in]``: a linear's weight; ``x_rows`` ``[n, in]``: inputs it saw (the
    ``rows`` of :func:`~workbench.quant.calib.collect_linear_inputs` with ``keep_rows``).
    ``schemes``: recipe strings (``"w4a16:g32"``), ``(label, recipe string)`` pairs, or
    ``(label, weight_fn[, act_fn])`` with ``weight_fn(w) -> W_q`` (dequantized, ``[out, in]``) and
    ``act_fn(x) -> x_q``; default :data:`DEFAULT_SCHEMES`.  ``outliers``: the input channels to
    single out (default: the ``top`` channels with the largest ``max|x_j|`` over ``x_rows``).

    With ``Y = x W^T`` and ``Y_q = x_q W_q^T`` (``x_q = x`` for weight-only schemes), the error
    ``E = Y_q - Y`` is a sum over input channels of ``x_q[:, j] W_q[:, j]^T - x[:, j] W[:, j]^T``;
    ``E_O`` sums the outlier channels' terms (every other column zeroed), ``E_R`` the rest, and
    ``E = E_O + E_R`` exactly.  One row per scheme:

    * ``scheme``; ``granularity`` / ``fallback`` / ``bits`` / ``act_bits`` for recipe strings;
    * ``rel_error`` - ``||E|| / ||Y||`` (Frobenius, over the ``n`` rows);
    * ``outlier_error`` / ``rest_error`` - ``||E_O|| / ||Y||`` and ``||E_R|| / ||Y||``;
    * ``outlier_share`` - ``||E_O||^2 / (||E_O||^2 + ||E_R||^2)``, the outliers' share of the
      error energy (a figure stacks ``rel_error`` in these proportions);
    * ``weight_error`` - ``||W_q - W|| / ||W||``; ``outlier_channels`` - the channels singled out.

    A per-token activation scale is set by the outlier channels, so with A8 the error they
    cause lands mostly in ``rest_error`` (the other channels get a coarse grid); a per-tensor
    or per-channel weight scale stretched by the outlier columns' weights does the same.
    """
    if w.dim() != 2 or x_rows.dim() != 2 or w.shape[1] != x_rows.shape[1]:
        raise ConfigError(f"scheme_errors: need w [out, in] and x_rows [n, in] of the same in; got "
                          f"{tuple(w.shape)} and {tuple(x_rows.shape)}")
    wd, xd = w.detach().double().cpu(), x_rows.detach().double().cpu()
    if outliers is None:
        outliers = _top(xd.abs().amax(0), top)
    o = torch.zeros(wd.shape[1], dtype=torch.bool)
    o[torch.as_tensor(outliers, dtype=torch.long)] = True
    y = xd @ wd.T
    yn = float(y.norm()) or 1.0
    rows = []
    for spec in schemes:
        label, wfn, afn, info = _scheme(spec, wd.shape[1])
        wq = wfn(w.detach().float().cpu()).double()
        xq = afn(x_rows.detach().float().cpu()).double() if afn is not None else xd
        e_o = xq[:, o] @ wq[:, o].T - xd[:, o] @ wd[:, o].T
        e_r = xq[:, ~o] @ wq[:, ~o].T - xd[:, ~o] @ wd[:, ~o].T
        no, nr = float(e_o.norm()), float(e_r.norm())
        rows.append({"scheme": label, **info, "rel_error": float((e_o + e_r).norm()) / yn,
                     "outlier_error": no / yn, "rest_error": nr / yn,
                     "outlier_share": no * no / (no * no + nr * nr) if no + nr > 0 else 0.0,
                     "weight_error": float((wq - wd).norm() / wd.norm().clamp_min(1e-30)),
                     "outlier_channels": o.nonzero().flatten().tolist()})
    return rows


def compare_stats(before: dict, after: dict, kind: str | None = None) -> list[dict]:
    """Per layer (of ``kind``, default every layer in both), the activation range before and after
    a transformation (SmoothQuant / AWQ folding: ``after`` recollected on the same calibration
    sequences from the transformed model): ``layer``, ``max_median_before`` / ``_after`` (max /
    median of ``max|x_j|``), ``absmax_before`` / ``_after`` (``max_j max|x_j|``),
    ``top_channel_before`` / ``_after`` (the channel holding it)."""
    names = [n for n in (_of_kind(before, kind) if kind else before) if n in after]
    if not names:
        raise ConfigError("compare_stats: the two statistics share no layer"
                          + (f" of kind {kind!r}" if kind else ""))
    rows = []
    for n in names:
        a, b = before[n].absmax.double().cpu(), after[n].absmax.double().cpu()
        rows.append({"layer": n, "kind": n.rsplit(".", 1)[-1], "max_median_before": _ratio(a),
                     "max_median_after": _ratio(b), "absmax_before": float(a.max()), "absmax_after": float(b.max()),
                     "top_channel_before": int(a.argmax()), "top_channel_after": int(b.argmax())})
    return rows
