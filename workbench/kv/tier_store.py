"""Where the physical tiered cache keeps the full K/V of warm and cold tokens, and how its
routed blocks come back: :class:`TierStore` (an offload tier, a predictor), with the names of
each (``OFFLOADS``, ``PREDICTORS``).  The predictors are described in
:mod:`workbench.kv.tiers_physical`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workbench.errors import ConfigError
from workbench.prefetch.prefetcher import Prefetcher
from workbench.prefetch.transports import make_transport

PREDICTORS = ("none", "step", "layer", "both")
OFFLOADS = ("host", "disk")


@dataclass(frozen=True)
class TierStore:
    """Where the full K/V of warm and cold tokens lives, and how routed blocks come back.

    ``offload``: ``"host"`` (RAM on a CPU; pinned host memory over PCIe on CUDA) or ``"disk"``
    (an ``O_DIRECT`` file; CPU only).  ``predict``: see :mod:`workbench.kv.tiers_physical`.  ``path``: the
    disk file (default: a temporary file)."""

    offload: str = "host"
    predict: str = "step"
    path: str | None = None

    def __post_init__(self) -> None:
        if self.offload not in OFFLOADS:
            raise ConfigError(f"TierStore field 'offload' must be one of {OFFLOADS}, got {self.offload!r}")
        if self.predict not in PREDICTORS:
            raise ConfigError(f"TierStore field 'predict' must be one of {PREDICTORS}, got {self.predict!r}")

    @property
    def name(self) -> str:
        return f"store={self.offload} predict={self.predict}"

    def make_prefetcher(self, device=None) -> Prefetcher:
        dev = torch.device(device) if device is not None else torch.device("cpu")
        if dev.type == "cuda":
            if self.offload == "disk":
                raise ConfigError("TierStore field 'offload' = 'disk' is for a CPU; on CUDA the offload tier "
                                  "is pinned host memory (offload='host')")
            return Prefetcher(make_transport("cuda", dev), name="kv tiers")
        kw = {"path": self.path} if self.offload == "disk" and self.path else {}
        return Prefetcher(make_transport(self.offload, dev, **kw), name="kv tiers")
