"""The kernel entry points a model's modules call: one typed :class:`Ops` per backend choice.

A plain model's modules run their own torch code (the reference): their declared ``ops`` field
is None.  :func:`workbench.transforms.backends.apply_backends` fills that field, on every norm,
attention, MLP and decoder layer and on the model itself, with one shared :class:`Ops`; the
modules it swaps in (:mod:`workbench.transforms.backend_modules`) call ``self.ops.rmsnorm(...)``
and so on, the KV caches call ``attn.ops.attention_decode(...)`` (:mod:`workbench.model.kv_cache`)
and the engine calls ``model.ops.sample_tokens(...)``.  Contracts of each entry point: the
docstring of :mod:`workbench.transforms.backends`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from collections.abc import Callable

import torch

Kernel = Callable[..., torch.Tensor]
Pair = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass(eq=False)
class Ops:
    """The resolved entry points of one backend choice (``ops.rmsnorm(x, w, eps)`` ...).

    ``backends``: op -> backend (``{"rmsnorm": "triton", "rope": "eager", ...}``); ``replaced``:
    entry point -> the name of the function standing in for it
    (:func:`workbench.transforms.backends.replace_entry_points`)."""

    backends: dict[str, str]
    rmsnorm: Kernel                     # (x, weight, eps) -> y
    add_rmsnorm: Pair                   # (x, residual, weight, eps) -> (norm(residual + x), residual + x)
    rope: Pair                          # (q, k, cos, sin, rows) -> (q, k) rotated
    rope_kv_write: Pair                 # (q, k, v, cos, sin, rows, k_cache, v_cache, slots) -> (q, k); k/v written
    swiglu: Kernel                      # (gate, up) -> silu(gate) * up
    attention_prefill: Kernel           # (q, k, v, causal) -> out
    attention_prefill_paged: Kernel     # (q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, max_seqlen_q)
    attention_decode: Kernel            # (q, k_cache, v_cache, block_tables, seq_lens) -> out
    greedy_tokens: Kernel               # the sampling op's entry points (the engine's, not a module's)
    sample_tokens: Kernel
    replaced: dict[str, str] = field(default_factory=dict)

    def uses_kernel(self, op: str) -> bool:
        """True when ``op`` runs on a backend other than ``eager``."""
        return self.backends.get(op, "eager") != "eager"

    def __repr__(self) -> str:
        extra = "".join(f" {e}<-{f}" for e, f in self.replaced.items())
        return f"Ops({' '.join(f'{op}={b}' for op, b in self.backends.items())}{extra})"


#: the entry points an :class:`Ops` holds, in field order
ENTRY_POINTS: tuple[str, ...] = tuple(f.name for f in fields(Ops) if f.name not in ("backends", "replaced"))
