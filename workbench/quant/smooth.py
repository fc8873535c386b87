"""SmoothQuant (Xiao et al., 2023): move activation outliers into the weights before W8A8.

::

    stats = collect_linear_inputs(model, calibration)          # per-channel max |x| of every linear
    rows = smooth_model(model, stats, alpha=0.5)                # in place; one report row per group
    quantize_model(model, "w8a8:smooth=0.5", calibration=seqs)  # the same, inside quantize_model

Per-token int8 activations (:func:`~workbench.quant.apply.fake_quantize_per_token`) share one
scale across a token's channels, so a few outlier channels waste the grid of all the others.
For every group of linears reading one input (:func:`~workbench.quant.fold.scale_groups`),
per input channel ``j``::

    s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)      both maxima clamped to >= 1e-5, s_j >= 1e-5
    X' = X / s   (folded into the preceding norm or linear)       W' = W diag(s)  (every consumer)

``max|X_j|`` is read from the calibration statistics (:mod:`workbench.quant.calib`),
``max|W_j|`` is the largest ``|w|`` in column ``j`` over all of the group's weights.  After
smoothing, channel ``j``'s range is ``max|X_j|^(1-alpha) max|W_j|^alpha``: ``alpha = 0`` leaves
activations alone (``s = 1 / max|W|``, weights normalized), ``alpha = 1`` moves the whole range
into the weights.

Report, one row per group: the layers, alpha, ``max|X|`` over channels before and after, and the
outlier ratio max / median of the per-channel ``max|X_j|`` before and after (the after values are
``max|X_j| / s_j``, exact because the fold is linear in the group's input); pairs that cannot be
folded (v -> o under grouped-query attention) come as rows with a ``skipped`` reason.

Differences from the paper: the paper smooths the inputs of the QKV projection and the first
MLP layer (the ones behind a LayerNorm); here every foldable group is smoothed, also down_proj
(through up_proj) and o_proj (through v_proj, without GQA).  One alpha for all groups (the
paper tunes it per model).  Statistics come from the caller's calibration sequences once,
before any group is folded (folding one group does not change another group's input).
"""

from __future__ import annotations

import torch
from torch import nn

from workbench.errors import ConfigError
from workbench.quant.calib import LinearInputs
from workbench.quant.fold import fold_scales, scale_groups, skipped_groups

EPS = 1e-5


def smooth_scales(act_absmax: torch.Tensor, weights: list[torch.Tensor], alpha: float) -> torch.Tensor:
    """``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` (float32 ``[in]``) for the consumers'
    weights ``[out_i, in]``."""
    w_max = torch.stack([w.detach().float().abs().amax(0) for w in weights]).amax(0).clamp_min(EPS)
    a_max = act_absmax.float().to(w_max.device).clamp_min(EPS)
    return (a_max.pow(alpha) / w_max.pow(1 - alpha)).clamp_min(EPS)


def outlier_ratio(absmax: torch.Tensor) -> float:
    """max / median of the per-channel absmax (how far the largest channel sticks out)."""
    a = absmax.float()
    return float(a.max() / a.median().clamp_min(1e-12))


def group_input_stats(stats: dict[str, LinearInputs], layers, who: str) -> LinearInputs:
    """The statistics of a group's shared input: any consumer's (they read the same tensor);
    a ConfigError naming the layers when none was collected."""
    for n in layers:
        if n in stats:
            return stats[n]
    raise ConfigError(f"{who}: no calibration statistics for {', '.join(layers)} (the layers reading one "
                      "input; collect_linear_inputs(model, sequences) collects every linear but the LM head)")


@torch.no_grad()
def smooth_model(model: nn.Module, stats: dict[str, LinearInputs], alpha: float) -> list[dict]:
    """Smooth every foldable group in place (see the module docstring); returns the report rows."""
    if not isinstance(alpha, (int, float)) or not 0 <= alpha <= 1:
        raise ConfigError(f"smooth_model: alpha must be in [0, 1], got {alpha!r}")
    groups = scale_groups(model)
    inputs = {g: group_input_stats(stats, g.layers, "smooth_model") for g in groups}   # check all before folding
    rows = []
    for g in groups:
        st = inputs[g]
        weights = [model.get_submodule(n).weight for n in g.layers]
        if st.absmax.numel() != weights[0].shape[1]:
            raise ConfigError(f"smooth_model: statistics for {g.layers[0]} have {st.absmax.numel()} channels, "
                              f"the layer reads {weights[0].shape[1]}")
        s = smooth_scales(st.absmax, weights, float(alpha))
        before = st.absmax.float()
        after = before.to(s.device) / s
        fold_scales(model, g, s)
        rows.append({"prev": g.prev, "layers": list(g.layers), "kind": g.kind, "layer": g.layer,
                     "alpha": float(alpha), "absmax_before": float(before.max()), "absmax_after": float(after.max()),
                     "outlier_ratio_before": outlier_ratio(before), "outlier_ratio_after": outlier_ratio(after),
                     "scale_min": float(s.min()), "scale_max": float(s.max())})
    return rows + skipped_groups(model)
