"""AWQ (Lin et al., 2024): activation-aware per-input-channel scales, then a clipping search.

::

    res = awq_search(model, QuantRecipe.parse("w4a16:g128:awq"), calibration)   # scales folded in place
    res.clip["model.layers.0.mlp.up_proj"]         # [out, n_groups] multipliers <= 1 of the RTN scales
    res.report                                      # per group: alpha, loss at alpha = 0 (RTN) and chosen
    quantize_model(model, "w4a16:g128:awq", calibration=seqs)   # the same, inside quantize_model

A few input channels carry large activations; their weight columns matter most.  Scaling
those columns up before round-to-nearest (and their inputs down, folded into the preceding
op) gives them finer steps.  For every group of linears sharing one input
(:func:`~workbench.quant.fold.scale_groups`), with ``X`` a sample of calibration rows of that
input and ``m_j = mean|X_j|`` over all calibration tokens::

    s(alpha) = m^alpha / sqrt(max(m^alpha) * min(m^alpha))          (m clamped to >= 1e-5)
    loss(alpha) = sum over the group's layers ||X (Q(W diag(s)) diag(1/s) - W)^T||^2 / (rows * outputs)
                = mean squared error of Q(W s) (X / s) against W X

for ``alpha`` on the grid ``0, 1/20, ..., 19/20``, with ``Q`` the round-to-nearest quantizer the
recipe gives each layer (:meth:`~workbench.quant.recipe.QuantRecipe.layer_settings`,
``quantize_weight(...).dequantize()``).  The best ``s`` is folded into the float model
(:func:`~workbench.quant.fold.fold_scales`).  ``alpha = 0`` is ``s = 1``, plain RTN, so the
chosen loss is never above RTN's on this objective (ties keep RTN).

Then, per quantized linear, the **clipping search**: per output channel and weight group, the
RTN scale is multiplied by ``c`` in ``linspace(1, 0.5, 20)`` and the ``c`` minimizing that
group's share of the output error, ``mean over rows of (X_g (Q_c(W)_g - W_g)^T)^2``, is kept.
The multipliers are returned (``AWQResult.clip[name]``, ``[out, n_groups]``, in ``(0, 1]``) for
``quantize_weight(..., scale_multiplier=...)``; a layer whose whole-output error the chosen
multipliers do not lower (the per-group choices ignore cross-group terms) keeps none.

Decoder layers are processed in order; each layer's inputs are collected
(:func:`~workbench.quant.calib.collect_linear_inputs`, ``rows`` sampled rows per linear, a
forward through the first layers only, no LM head) after the earlier layers' scales were
folded, and a group's rows are divided by its scale once folded.  (Folding keeps the float
function, so these are the original inputs up to rounding; collecting per layer keeps one
layer's rows in memory at a time.)  The report has one row per group (``alpha``, ``loss_rtn``
= the loss at alpha 0, ``loss``, all ``losses``) and one per skipped v -> o pair, each with
``clip``: per layer ``loss_before`` / ``loss_after`` (whole-output mean squared error on the
rows, RTN with the folded scale vs with the chosen multipliers) or ``searched: False``.

Simplifications relative to the paper and its reference code (AutoAWQ):

* the loss is over the group's *linear outputs* (q, k, v concatenated; gate and up; down; o),
  not the output of the whole block behind them (attention, the SwiGLU product);
* the loss reads a sample of ``rows`` input rows (512 by default), not every calibration token;
  ``m`` (the salience) does read every token;
* the float model feeds each layer (no quantized layers upstream), as in AutoAWQ;
* under grouped-query attention the v -> o pair gets no scale (o_proj: clipping only), as in
  AutoAWQ; the clipping search skips q_proj and k_proj, as AutoAWQ does (``CLIP_SKIP``);
* per-tensor layers (one scale for the whole weight) get no clipping search.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from workbench.errors import ConfigError
from workbench.quant.calib import collect_linear_inputs
from workbench.quant.fold import ScaleGroup, fold_scales, scale_groups, skipped_groups
from workbench.quant.recipe import QuantRecipe
from workbench.quant.rtn import quantize_weight

GRID = 20                       # alpha grid: 0, 1/20, ..., 19/20
CLIP_GRID = 20                  # clip multipliers: linspace(1, MIN_SHRINK, CLIP_GRID)
MIN_SHRINK = 0.5
ROWS = 512                      # sampled calibration rows per linear for the losses
CLIP_SKIP = ("q_proj", "k_proj")
EPS = 1e-5


@dataclass
class AWQResult:
    clip: dict[str, torch.Tensor] = field(default_factory=dict)     # name -> [out, n_groups] in (0, 1], weight's device
    report: list[dict] = field(default_factory=list)


def _quantized(recipe: QuantRecipe, name: str) -> bool:
    return not recipe.skips(name)


def _qdq(w: torch.Tensor, st: dict, mult: torch.Tensor | None = None) -> torch.Tensor:
    """Round-to-nearest as the recipe gives this layer, back in float32."""
    return quantize_weight(w, bits=st["bits"], group=st["group"], per_channel=st["per_channel"],
                           symmetric=st["symmetric"], scale_multiplier=mult).dequantize(torch.float32)


def awq_scales(absmean: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = m^alpha / sqrt(max * min)`` (``m`` clamped to >= 1e-5): float32 ``[in]``."""
    s = absmean.float().clamp_min(EPS).pow(alpha)
    return s / (s.max() * s.min()).sqrt()


def _gram(x: torch.Tensor) -> torch.Tensor | None:
    """``x^T x`` when the input is narrower than the sample (then ``||x d^T||^2 = sum((d x^T x) * d)``
    is the cheaper way), else None."""
    return x.T @ x if x.shape[1] < x.shape[0] else None


def _sq_err(x: torch.Tensor, d: torch.Tensor, gram: torch.Tensor | None) -> float:
    """``||x d^T||^2``."""
    if gram is not None:
        return float(((d @ gram) * d).sum())
    return float(torch.linalg.vector_norm(x @ d.T)) ** 2


def group_loss(x: torch.Tensor, weights: list[torch.Tensor], settings: list[dict], s: torch.Tensor,
               gram: torch.Tensor | None = None) -> float:
    """Mean squared error of ``Q(W diag(s)) (X / s)`` against ``X W^T`` over the layers' outputs
    (``gram``: :func:`_gram` of ``x``, computed once by the caller)."""
    err = n = 0.0
    for w, st in zip(weights, settings):
        wf = w.float()
        err += _sq_err(x, _qdq(wf * s[None, :], st) / s[None, :] - wf, gram)
        n += x.shape[0] * w.shape[0]
    return err / max(n, 1)


def search_scale(x: torch.Tensor, absmean: torch.Tensor, weights: list[torch.Tensor], settings: list[dict],
                 grid: int = GRID) -> tuple[float, torch.Tensor, float, list[float]]:
    """The grid search: (best alpha, its scale ``[in]``, its loss, the loss at every alpha of
    the grid; ``losses[0]`` is plain RTN's)."""
    losses, best = [], (0.0, None, float("inf"))
    gram = _gram(x)
    for i in range(grid):
        a = i / grid
        s = awq_scales(absmean, a).to(x.device)
        loss = group_loss(x, weights, settings, s, gram)
        losses.append(loss)
        if loss < best[2]:
            best = (a, s, loss)
    if best[1] is None:                   # every loss NaN: keep RTN
        best = (0.0, torch.ones_like(absmean, dtype=torch.float32, device=x.device), losses[0])
    return best[0], best[1], best[2], losses


def output_error(x: torch.Tensor, w: torch.Tensor, st: dict, mult: torch.Tensor | None = None) -> float:
    """Mean squared output error of the quantized layer on rows ``x``."""
    return _sq_err(x, _qdq(w, st, mult) - w.float(), _gram(x)) / max(x.shape[0] * w.shape[0], 1)


def search_clip(x: torch.Tensor, w: torch.Tensor, st: dict, grid: int = CLIP_GRID,
                min_shrink: float = MIN_SHRINK) -> torch.Tensor:
    """Per output channel and weight group, the scale multiplier in ``linspace(1, min_shrink,
    grid)`` minimizing ``mean over rows of (X_g (Q_c(W)_g - W_g)^T)^2`` -> ``[out, n_groups]``.

    Computed as ``d^T H_g d`` with ``H_g = X_g^T X_g / rows`` (the same number, without the
    ``[rows, out, groups]`` intermediate)."""
    out, n = w.shape
    gs = st["group"] or n
    ng = n // gs
    xg = x.float().reshape(-1, ng, gs).permute(1, 0, 2)                       # [G, N, g]
    h = xg.transpose(1, 2) @ xg / max(x.shape[0], 1)                          # [G, g, g]
    wf = w.float()
    best = torch.ones(out, ng, device=w.device)
    best_err = torch.full((out, ng), float("inf"), device=w.device)
    for f in torch.linspace(1.0, min_shrink, grid).tolist():
        mult = torch.full((out, ng), f, device=w.device)
        d = (_qdq(wf, st, mult) - wf).reshape(out, ng, gs).permute(1, 0, 2)    # [G, out, g]
        err = ((d @ h) * d).sum(-1).T                                         # [out, G]
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best = torch.where(better, torch.full_like(best, f), best)
    return best


@torch.no_grad()
def awq_search(model: nn.Module, recipe: QuantRecipe | str, sequences, *, grid: int = GRID,
               clip_grid: int = CLIP_GRID, rows: int = ROWS, clip_skip=CLIP_SKIP, seed: int = 0) -> AWQResult:
    """Search and fold AWQ's scales, then search the clipping (see the module docstring).
    In place on ``model``'s float weights; returns the clip multipliers and the report."""
    recipe = QuantRecipe.parse(recipe) if isinstance(recipe, str) else recipe
    if grid < 1 or clip_grid < 1 or rows < 1:
        raise ConfigError(f"awq_search: grid, clip_grid and rows must be >= 1, got {grid}, {clip_grid}, {rows}")
    seqs = [list(s) for s in (sequences or [])]
    if not seqs:
        raise ConfigError("awq_search: AWQ reads activations; pass calibration token sequences")
    groups = scale_groups(model)
    skipped = skipped_groups(model)
    n_layers = len(model.model.layers)
    res = AWQResult()
    for i in range(n_layers):
        t0 = time.perf_counter()
        p = f"model.layers.{i}"
        names = [f"{p}.self_attn.{k}_proj" for k in "qkvo"] + [f"{p}.mlp.{k}_proj" for k in ("gate", "up", "down")]
        with _first_layers(model, i + 1):
            stats = collect_linear_inputs(model, seqs, names=names, keep_rows=rows, seed=seed + i)
        xs = {n: stats[n].rows.float() for n in names}
        mods = {n: model.get_submodule(n) for n in names}
        bad = [n for n in names if type(mods[n]) is not nn.Linear]
        if bad:
            raise ConfigError(f"awq_search: {bad[0]} is a {type(mods[bad[0]]).__name__}, not a plain nn.Linear "
                              "(AWQ runs on the float model, before quantize_model replaces its layers)")
        sets = {n: recipe.layer_settings(n, mods[n].in_features) for n in names}
        layer_rows: list[dict] = []
        for g in (g for g in groups if g.layer == i):
            layer_rows.append(_scale_group(model, g, stats, xs, mods, sets, recipe, grid))
        layer_rows += [dict(r) for r in skipped if r["layer"] == i]
        for n in names:
            if not _quantized(recipe, n):
                continue
            st, w = sets[n], mods[n].weight
            row = next(r for r in layer_rows if n in r["layers"])
            if any(k in n.split(".")[-1] for k in clip_skip) or (st["group"] is None and not st["per_channel"]):
                row.setdefault("clip", {})[n] = {"searched": False}
                continue
            x = xs[n].to(w.device)
            mult = search_clip(x, w, st, clip_grid)
            before, after = output_error(x, w, st), output_error(x, w, st, mult)
            kept = after < before
            if kept:
                res.clip[n] = mult
            row.setdefault("clip", {})[n] = {"searched": True, "loss_before": before,
                                             "loss_after": after if kept else before, "kept": kept,
                                             "mean_multiplier": float(mult.mean()) if kept else 1.0,
                                             "min_multiplier": float(mult.min()) if kept else 1.0}
        for r in layer_rows:
            r["seconds_layer"] = time.perf_counter() - t0
        res.report += layer_rows
    return res


@contextmanager
def _first_layers(model: nn.Module, n: int):
    """The model runs its first ``n`` decoder layers only, and no LM head (a calibration forward
    for layer ``n - 1``'s inputs need not compute what follows); restored on exit."""
    stack, head = model.model, getattr(model, "lm_head", None)
    layers = stack.layers
    try:
        stack.layers = nn.ModuleList(list(layers)[:n])
        if isinstance(head, nn.Module):
            model.lm_head = nn.Identity()
        yield
    finally:
        stack.layers = layers
        if isinstance(head, nn.Module):
            model.lm_head = head


def _scale_group(model: nn.Module, g: ScaleGroup, stats, xs, mods, sets, recipe: QuantRecipe, grid: int) -> dict:
    row = {"prev": g.prev, "layers": list(g.layers), "kind": g.kind, "layer": g.layer}
    targets = [n for n in g.layers if _quantized(recipe, n)]
    if not targets:
        return {**row, "skipped": "no quantized layer reads this input"}
    w0 = mods[g.layers[0]].weight
    x = xs[g.layers[0]].to(w0.device)
    weights, settings = [mods[n].weight for n in targets], [sets[n] for n in targets]
    alpha, s, loss, losses = search_scale(x, stats[g.layers[0]].absmean, weights, settings, grid)
    if alpha > 0:
        fold_scales(model, g, s)
        for n in g.layers:
            xs[n] = xs[n] / s.to(xs[n].device)[None, :]
    return {**row, "alpha": alpha, "loss_rtn": losses[0], "loss": loss,
            "losses": losses, "scale_min": float(s.min()), "scale_max": float(s.max())}
