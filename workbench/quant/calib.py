"""What the linear layers see: input statistics gathered on calibration text.

::

    stats = collect_linear_inputs(model, sequences)                    # every nn.Linear / QuantLinear
    stats = collect_linear_inputs(model, sequences, names=["model.layers.0.mlp.down_proj"],
                                  hessian=True, keep_rows=512)
    stats["model.layers.0.mlp.down_proj"].absmax                      # [in] max |x| per input channel

``sequences`` are lists of token ids (the calibration half of the held-out corpus in the
benchmarks: never an evaluation token).  One plain forward per sequence, forward hooks on the
chosen layers; nothing in the model changes.  Per layer (:class:`LinearInputs`):

* ``absmax`` / ``absmean`` ``[in]`` - max and mean of ``|x|`` per input channel (the outlier
  channels that set an activation quantizer's range; AWQ's salience and SmoothQuant's
  migration read them);
* ``hessian`` ``[in, in]`` float64 - ``X^T X / rows`` (GPTQ's proxy Hessian ``2 X^T X`` up to the
  factor), only with ``hessian=True``;
* ``rows`` ``[keep_rows, in]`` - a seeded uniform sample of input rows (for losses measured on
  real activations), only with ``keep_rows > 0``.

Everything is accumulated in float64 on the model's device, so the statistics do not depend on
how the text is cut into sequences (up to float64 rounding).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from workbench.errors import ConfigError


@dataclass
class LinearInputs:
    count: int                        # input rows seen (tokens)
    absmax: torch.Tensor              # [in] float32
    absmean: torch.Tensor             # [in] float32
    hessian: torch.Tensor | None      # [in, in] float64, X^T X / count
    rows: torch.Tensor | None         # [k, in] float32 sample of inputs


def linear_names(model: nn.Module) -> list[str]:
    """Names of the modules with a 2-D ``weight`` and an ``in_features`` (nn.Linear, QuantLinear),
    in module order, the LM head included."""
    return [n for n, m in model.named_modules() if hasattr(m, "in_features") and hasattr(m, "out_features")]


class _Acc:
    def __init__(self, width: int, hessian: bool, keep_rows: int, gen: torch.Generator) -> None:
        self.n, self.keep, self.gen = 0, keep_rows, gen
        self.mx = torch.zeros(width, dtype=torch.float64)
        self.sum = torch.zeros(width, dtype=torch.float64)
        self.h = torch.zeros(width, width, dtype=torch.float64) if hessian else None
        self.rows: list[torch.Tensor] = []
        self.keys: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).double().cpu()
        a = x.abs()
        self.mx = torch.maximum(self.mx, a.amax(0))
        self.sum += a.sum(0)
        if self.h is not None:
            self.h += x.T @ x
        if self.keep:          # reservoir by random keys: a uniform sample whatever the split into calls
            self.keys.append(torch.rand(x.shape[0], generator=self.gen, dtype=torch.float64))
            self.rows.append(x.float())
            k = torch.cat(self.keys)
            if k.numel() > self.keep:
                top = k.topk(self.keep).indices
                self.keys, self.rows = [k[top]], [torch.cat(self.rows)[top]]
        self.n += x.shape[0]

    def result(self) -> LinearInputs:
        n = max(self.n, 1)
        return LinearInputs(self.n, self.mx.float(), (self.sum / n).float(),
                            None if self.h is None else self.h / n,
                            torch.cat(self.rows) if self.rows else None)


@torch.no_grad()
def collect_linear_inputs(model: nn.Module, sequences, names=None, hessian: bool = False,
                          keep_rows: int = 0, seed: int = 0) -> dict[str, LinearInputs]:
    """Input statistics of the linear layers ``names`` (default: all but the LM head) over
    ``sequences`` (token-id lists), one forward each."""
    mods = dict(model.named_modules())
    names = [n for n in linear_names(model) if not n.endswith("lm_head")] if names is None else list(names)
    missing = [n for n in names if n not in mods]
    if missing:
        raise ConfigError(f"collect_linear_inputs: no module named {missing[:3]} in the model")
    seqs = [list(s) for s in sequences]
    if not seqs or any(len(s) == 0 for s in seqs):
        raise ConfigError("collect_linear_inputs: calibration needs at least one non-empty token sequence")
    gen = torch.Generator().manual_seed(seed)
    accs = {n: _Acc(mods[n].in_features, hessian, keep_rows, gen) for n in names}
    hooks = [mods[n].register_forward_pre_hook(lambda _m, args, n=n: accs[n].add(args[0])) for n in names]
    device = next(model.parameters()).device
    try:
        for s in seqs:
            model(torch.as_tensor(s, dtype=torch.long, device=device)[None])
    finally:
        for h in hooks:
            h.remove()
    return {n: a.result() for n, a in accs.items()}
