"""GPTQ: one-shot, Hessian-based weight rounding with error feedback (Frantar et al., 2022).

::

    res = gptq_quantize(model, QuantRecipe.parse("w4a16:g128:gptq"), calibration_seqs)
    res.weights["model.layers.0.mlp.down_proj"]     # QuantizedWeight (the rtn storage format)
    res.report                                      # per layer: proxy loss GPTQ vs RTN, damping, time
    q, deq, info = gptq_weight(w, h, bits=4, group=32)   # one weight [out, in] and its Hessian [in, in]

``quantize_model(model, "w4a16:g128:gptq", calibration=seqs)`` calls :func:`gptq_quantize` and
stores its weights as :class:`~workbench.quant.apply.QuantLinear` (same storage as
round-to-nearest: only *which* integers are chosen differs).

**The objective.**  For a linear layer ``y = x W^T`` with calibration inputs ``X [n, in]``,
find the quantized ``Q`` minimizing the layer's output error, row by row::

    ||X W^T - X Q^T||^2 / n  =  tr((W - Q) H (W - Q)^T),     H = X^T X / n    (the proxy loss)

(:func:`~workbench.quant.calib.collect_linear_inputs` gives ``H`` in float64).  Each row of
``W`` is an independent problem with the same ``H``.

**The algorithm** (OBS-style, columns in a fixed order, all rows at once).  With
``U = chol(H^-1)^T`` the upper Cholesky factor (``H^-1 = U^T U``), for each column ``j``::

    q_j  = quant(w_j)                       (the current column, on its group's grid)
    e_j  = (w_j - q_j) / U_jj
    w_k -= e_j U_jk        for every k > j  (error feedback onto the not yet quantized columns)

which is the optimal update of the remaining columns given the rounding of column ``j``
(the Cholesky rows are the successive inverse-Hessian rows of OBS, with the eliminations
already applied).  *Lazy batch updates*: columns are processed in blocks of ``block_size``;
inside a block the update touches only the block's columns, and the block's accumulated
errors ``E [out, block]`` are applied to all later columns at once, ``W[:, i2:] -= E U[i1:i2, i2:]``
(the same arithmetic, done as one matrix product instead of ``block_size`` rank-1 updates).

**Numerics.**  ``H`` is damped, ``H += damp * mean(diag H) * I`` (``damp = 0.01``; if the
Cholesky factorisation still fails the damping is multiplied by 10, up to 4 times, and the
report says which was used).  *Dead inputs* (``H_jj == 0``: the input channel was always
zero on the calibration text) get ``H_jj = 1`` and ``W[:, j] = 0``, as in the paper's code: they
do not affect the calibration output, and 0 is exactly representable.  ``H``, its factor and
the error-updated weights are float64; every quantized value is computed as the stored format
computes it, ``(q - z) * s`` in float32, so that
:meth:`~workbench.quant.rtn.QuantizedWeight.dequantize` of the result equals the loop's ``Q``
exactly (``encode_weight(Q, scales, zeros)`` re-derives the same integers from ``Q``).

**Scales** (:func:`~workbench.quant.rtn.compute_scales`, the round-to-nearest rule):

* per channel / per tensor: from the original weight, up front;
* groups of ``g`` columns (``act_order=False``): when column ``j`` starts a group
  (``j % g == 0``), the group's scales (and zero points) are computed from the *current*
  weights of its ``g`` columns - already moved by the error feedback of every earlier column
  (the standard GPTQ-with-groups behaviour).  "Current" is exact here: for group columns
  beyond the current block, the block's pending lazy update is applied to them first, so the
  result does not depend on ``block_size`` (the reference code reads stale values there when
  a group starts mid-block);
* ``act_order=True``: columns are processed in order of decreasing ``H_jj`` (the most
  active inputs first, their error spread over more columns), with *static groups*: every
  group's scales come from the original weight (dead columns zeroed) *before* permuting, so
  column ``j`` always uses group ``j // g`` and the storage needs no ``g_idx``.  Implemented,
  not the default (the recipe has no switch for it; call :func:`gptq_quantize` directly).

**Sequential over decoder layers.**  The linears are handled one decoder layer at a time (the
linears named ``...layers.<i>....`` form layer ``i``; any other linear is its own step).  For
each step the Hessians of its linears are collected with *the model as it is now*: after a
step, every quantized linear's float weight is overwritten **in place** with its dequantized
weight, so later layers calibrate on the activations the quantized model produces (errors of
earlier layers are part of what later layers compensate).  The linears of one decoder layer
share one collection (q/k/v/o/gate/up/down all see the float layer's activations; the
"true-sequential" variant, one collection per sub-block, is not done).  When every step is
done the original float weights are **restored** (``restore=True``, the default), so the model
is unchanged and :func:`~workbench.quant.apply.quantize_model` measures each layer's weight
error against the true weight; ``restore=False`` leaves the dequantized weights in place.

**Report** (``GPTQResult.report``), one row per layer: ``layer``, ``in``, ``out``, ``bits``,
``group`` (the effective one after the recipe's group fallback; None = per channel / tensor),
``granularity``, ``symmetric``, ``loss_gptq`` and ``loss_rtn`` - the proxy loss
``tr((W - Q) H (W - Q)^T)`` of GPTQ and of plain round-to-nearest on the same undamped ``H``
(the mean squared output error per token, summed over output channels) - their ratio
``loss_ratio``, ``rel_loss_gptq`` = ``loss_gptq / tr(W H W^T)``, ``damp`` (used), ``dead``
(dead inputs), ``tokens`` and ``seconds`` (this layer's GPTQ solve; the Hessian collection is
counted in ``GPTQResult.seconds``, the whole run).

Simplifications: no "true-sequential" sub-steps; activations are the model's float ones even
for W4A8 / W8A8 recipes (the per-token int8 rounding of inputs is not simulated during
calibration); the proxy loss is measured on the calibration text only.
"""

from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from workbench.errors import ConfigError
from workbench.quant.apply import target_names  # noqa: F401 - also this module's API (the layers GPTQ solves)
from workbench.quant.recipe import QuantRecipe
from workbench.quant.rtn import QuantizedWeight, compute_scales, encode_weight, qrange, quantize_weight
from workbench.quant.calib import collect_linear_inputs

_DAMP_RETRIES = 4


@dataclass
class GPTQResult:
    weights: dict[str, QuantizedWeight]            # layer name -> stored weight
    report: list[dict]                             # one row per layer (see the module docstring)
    seconds: float = 0.0                           # the whole run: collection + solves
    steps: list[list[str]] = field(default_factory=list)   # the layers of each sequential step


def _quant_column(w: torch.Tensor, s: torch.Tensor, z: torch.Tensor | None, lo: int, hi: int) -> torch.Tensor:
    """One column ``w [out]`` (float64) on the grid ``s`` / ``z`` ([out] float32 each), dequantized
    exactly as the storage does it: ``(q - z) * s`` in float32."""
    r = torch.round(w / s.double())
    if z is None:
        q = r.clamp(lo, hi).float()
        return q * s
    q = (r + z.double()).clamp(lo, hi).float()
    return (q - z) * s


def _factor(h: torch.Tensor, damp: float) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor ``U`` of ``(H + damp * mean(diag H) * I)^-1`` (float64) and the damp used."""
    n = h.shape[0]
    mean_diag = float(torch.diagonal(h).mean())
    eye = torch.eye(n, dtype=h.dtype, device=h.device)
    d = damp
    for _ in range(_DAMP_RETRIES + 1):
        l, info = torch.linalg.cholesky_ex(h + d * mean_diag * eye)
        if int(info) == 0:
            hinv = torch.cholesky_inverse(l)
            u, info = torch.linalg.cholesky_ex(hinv, upper=True)
            if int(info) == 0 and bool(torch.isfinite(u).all()):
                return u, d
        d = d * 10 if d > 0 else 1e-6
    raise ConfigError(f"gptq: the Hessian is not positive definite even with damping {d / 10:g} "
                      "(too few calibration tokens for this layer's width?)")


def proxy_loss(w: torch.Tensor, q: torch.Tensor, h: torch.Tensor) -> float:
    """``tr((W - Q) H (W - Q)^T)`` in float64: ``||X W^T - X Q^T||^2 / n`` for ``H = X^T X / n``."""
    d = (w.double() - q.double()).to(h.device)
    return float(((d @ h.double()) * d).sum())


@torch.no_grad()
def gptq_weight(w: torch.Tensor, h: torch.Tensor, bits: int = 4, group: int | None = None,
                per_channel: bool = True, symmetric: bool = True, damp: float = 0.01,
                block_size: int = 128, act_order: bool = False) -> tuple[QuantizedWeight, torch.Tensor, dict]:
    """GPTQ of one weight ``w [out, in]`` with the Hessian ``h [in, in]`` (``X^T X / n``; see the
    module docstring).  Returns the stored weight (:func:`~workbench.quant.rtn.encode_weight`
    of the result, ``dtype`` = ``w``'s), the loop's dequantized weight ``Q`` (float32,
    ``== stored.dequantize(torch.float32)``) and ``{"damp", "dead"}``."""
    if w.dim() != 2 or h.shape != (w.shape[1], w.shape[1]):
        raise ConfigError(f"gptq: expected w [out, in] and h [in, in], got {tuple(w.shape)} and {tuple(h.shape)}")
    if block_size < 1:
        raise ConfigError(f"gptq: block_size must be >= 1, got {block_size}")
    out, n = w.shape
    if group is not None and (group < 1 or n % group):
        raise ConfigError(f"gptq: group {group} does not divide the input width {n} "
                          "(the recipe's group fallback decides what such a layer gets)")
    lo, hi = qrange(bits, symmetric)
    dev = w.device
    W = w.detach().to(dev, torch.float64).clone()
    H = h.detach().to(dev, torch.float64).clone()
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    # Scales fixed up front: per channel / per tensor from the original weight; static groups
    # (act_order) from the original weight with dead columns zeroed, before permuting.
    fixed_s = fixed_z = None
    if group is None:
        fixed_s, fixed_z = compute_scales(w.detach().float(), bits, None, per_channel, symmetric)
    elif act_order:
        fixed_s, fixed_z = compute_scales(W.float(), bits, group, per_channel, symmetric)
    n_groups = 1 if group is None else n // group

    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True, stable=True)
        W, H = W[:, perm], H[perm][:, perm]

    U, used = _factor(H, damp)
    Q = torch.zeros(out, n, dtype=torch.float32, device=dev)
    scales = torch.zeros(out, n_groups, dtype=torch.float32, device=dev) if fixed_s is None else fixed_s
    zeros = None if symmetric else (torch.zeros_like(scales) if fixed_z is None else fixed_z)
    s_col = z_col = None
    if group is None:                                    # [out] (per tensor: expanded)
        s_col = fixed_s.reshape(-1).expand(out) if fixed_s.numel() == 1 else fixed_s[:, 0]
        z_col = None if symmetric else (fixed_z.reshape(-1).expand(out) if fixed_z.numel() == 1 else fixed_z[:, 0])

    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        U1 = U[i1:i2, i1:i2]
        for i in range(i2 - i1):
            j = i1 + i
            if group is not None:
                if act_order:
                    g = int(perm[j]) // group
                    s_col, z_col = scales[:, g], (None if symmetric else zeros[:, g])
                elif j % group == 0:
                    cur = W1[:, i:min(i + group, i2 - i1)]
                    if j + group > i2:             # the group runs past the block: apply the pending update
                        cur = torch.cat([cur, W[:, i2:j + group] - E1[:, :i] @ U[i1:j, i2:j + group]], 1)
                    s, z = compute_scales(cur.float(), bits, None, True, symmetric)
                    scales[:, j // group] = s[:, 0]
                    s_col = s[:, 0]
                    if not symmetric:
                        zeros[:, j // group] = z[:, 0]
                        z_col = z[:, 0]
            col = W1[:, i]
            dq = _quant_column(col, s_col, z_col, lo, hi)
            Q[:, j] = dq
            e = (col - dq.double()) / U1[i, i]
            W1[:, i:].addr_(e, U1[i, i:], alpha=-1.0)      # w_k -= e_j U_jk, k >= j in the block
            E1[:, i] = e
        if i2 < n:
            W[:, i2:] -= E1 @ U[i1:i2, i2:]

    if perm is not None:
        Q = Q[:, torch.argsort(perm)]
    stored = encode_weight(Q, scales, zeros, bits, group, per_channel if group is None else True)
    stored = dataclasses.replace(stored, dtype=w.dtype)
    return stored, Q, {"damp": used, "dead": int(dead.sum())}


def sequential_steps(names: list[str]) -> list[list[str]]:
    """``names`` grouped by decoder layer (the prefix up to the first all-digit component,
    ``model.layers.3``), in order of first appearance; a name without one is its own step."""
    steps: dict[str, list[str]] = {}
    for n in names:
        m = re.match(r"^(.*?\.\d+)(\.|$)", n)
        steps.setdefault(m.group(1) if m else n, []).append(n)
    return list(steps.values())


def _granularity(group: int | None, per_channel: bool) -> str:
    return f"g{group}" if group else "per-channel" if per_channel else "per-tensor"


@torch.no_grad()
def gptq_quantize(model: nn.Module, recipe: QuantRecipe | str, sequences, damp: float = 0.01,
                  block_size: int = 128, act_order: bool = False, names: list[str] | None = None,
                  restore: bool = True) -> GPTQResult:
    """GPTQ of the layers ``names`` (default: those :func:`~workbench.quant.apply.quantize_model`
    targets) with each layer's settings from ``recipe.layer_settings``, calibrated on
    ``sequences`` (token-id lists), one decoder layer after the other; each step calibrates on
    the model with the earlier steps' dequantized weights written into it in place, and the
    float weights are put back at the end unless ``restore=False`` (see the module docstring)."""
    t_all = time.perf_counter()

    recipe = QuantRecipe.parse(recipe) if isinstance(recipe, str) else recipe
    seqs = [list(s) for s in (sequences or [])]
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ConfigError("gptq_quantize: calibration needs at least one non-empty token sequence "
                          "(e.g. heldout_split(tokenizer)['calibration'])")
    mods = dict(model.named_modules())
    names = target_names(model, recipe) if names is None else list(names)
    if not names:
        raise ConfigError("gptq_quantize: no nn.Linear to quantize")
    missing = [n for n in names if n not in mods]
    if missing:
        raise ConfigError(f"gptq_quantize: no module named {missing[:3]} in the model")
    wrong = [n for n in names if not isinstance(mods[n], nn.Linear)]
    if wrong:
        raise ConfigError(f"gptq_quantize: {wrong[:3]} are not nn.Linear (already quantized?)")

    steps = sequential_steps(names)
    originals: dict[str, torch.Tensor] = {}
    weights: dict[str, QuantizedWeight] = {}
    report: list[dict] = []
    ok = False
    try:
        for step in steps:
            stats = collect_linear_inputs(model, seqs, names=step, hessian=True)
            for name in step:
                lin = mods[name]
                st = recipe.layer_settings(name, lin.in_features)
                w = lin.weight.detach()
                h = stats[name].hessian.to(w.device)
                t0 = time.perf_counter()
                qw, deq, info = gptq_weight(w, h, st["bits"], st["group"], st["per_channel"], st["symmetric"],
                                            damp=damp, block_size=block_size, act_order=act_order)
                secs = time.perf_counter() - t0
                rtn = quantize_weight(w, st["bits"], st["group"], st["per_channel"], st["symmetric"])
                loss_g, loss_r = proxy_loss(w, deq, h), proxy_loss(w, rtn.dequantize(torch.float32), h)
                ref = proxy_loss(w, torch.zeros_like(w), h)
                report.append({"layer": name, "in": lin.in_features, "out": lin.out_features, "bits": st["bits"],
                               "group": st["group"], "granularity": _granularity(st["group"], st["per_channel"]),
                               "symmetric": st["symmetric"], "loss_gptq": loss_g, "loss_rtn": loss_r,
                               "loss_ratio": loss_g / loss_r if loss_r > 0 else float("nan"),
                               "rel_loss_gptq": loss_g / ref if ref > 0 else float("nan"),
                               "damp": info["damp"], "dead": info["dead"], "tokens": stats[name].count,
                               "act_order": act_order, "seconds": secs})
                weights[name] = qw
                originals[name] = w.clone()
                lin.weight.data.copy_(qw.dequantize(lin.weight.dtype))   # later steps see the quantized layer
        ok = True
    finally:
        if restore or not ok:                 # a failed run always leaves the model as it was
            for name, w0 in originals.items():
                mods[name].weight.data.copy_(w0)
    return GPTQResult(weights, report, time.perf_counter() - t_all, steps)
