"""The KV cache of one sequence, for :class:`~workbench.engine.runners.ContiguousRunner`.

A :class:`CacheFactory` makes a sequence's cache when it is first scheduled (``make(max_len)``)
and is told when the sequence ends (``finish``: the cache is kept for inspectors, ``release``:
it is done with).  Three kinds, picked by :func:`~workbench.engine.modes.make_runner`:

* :class:`ContiguousCaches` - a contiguous :class:`~workbench.model.kv_cache.KVCache` (the reference);
* :class:`TieredCaches` - an accounted :class:`~workbench.kv.tiers.TieredKVCache` (hot / warm / cold);
* :class:`PhysicalTieredCaches` - a :class:`~workbench.kv.tiers_physical.PhysicalTieredKVCache`: only
  the resident zones in fast memory, full blocks in the store's offload tier, routed blocks back
  through one prefetcher shared by the engine's sequences.

The tiered ones keep the last ended sequence's cache (``keep_last``): ``LLM.last_cache`` and the
tier inspectors read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import torch

from workbench.model.config import ModelConfig
from workbench.model.kv_cache import KVCache
from workbench.kv.tiers import TieredKVCache
from workbench.kv.tiers_physical import PhysicalTieredKVCache

if TYPE_CHECKING:
    from workbench.kv.pca import PCABasis
    from workbench.kv.tier_config import TierConfig
    from workbench.kv.tier_store import TierStore
    from workbench.prefetch.prefetcher import Prefetcher


@dataclass(kw_only=True)
class CacheFactory:
    """Makes one sequence's KV cache (``make``) on ``device`` in ``dtype``; ``finish`` / ``release``
    for when the sequence ends (no-ops unless the cache holds something outside its tensors)."""

    config: ModelConfig
    device: torch.device | None = None
    dtype: torch.dtype = torch.float32
    keep_last: ClassVar[bool] = False      # keep the last ended sequence's cache for inspectors

    def make(self, max_len: int):
        """A cache for one sequence of up to ``max_len`` tokens."""
        raise NotImplementedError

    def finish(self, cache) -> None:
        """``cache``'s sequence ended and the cache is kept (``keep_last``): stop work in flight."""

    def release(self, cache) -> None:
        """``cache`` is done with: whatever it holds outside its tensors goes."""


@dataclass(kw_only=True)
class ContiguousCaches(CacheFactory):
    """A contiguous :class:`~workbench.model.kv_cache.KVCache` per sequence (the reference)."""

    def make(self, max_len: int) -> KVCache:
        return KVCache(self.config, 1, max_len, device=self.device, dtype=self.dtype)


@dataclass(kw_only=True)
class TieredCaches(CacheFactory):
    """An accounted :class:`~workbench.kv.tiers.TieredKVCache` per sequence with ``tiers`` (and
    ``basis``); the set-up is checked when the factory is made, not per request."""

    tiers: TierConfig
    basis: PCABasis | None = None
    keep_last: ClassVar[bool] = True

    def __post_init__(self) -> None:
        self._new(1)                                     # validate now, not per request

    def make(self, max_len: int):
        return self._new(max_len, device=self.device, dtype=self.dtype)

    def _new(self, max_len: int, **where):
        return TieredKVCache(self.config, self.tiers, self.basis, max_len=max_len, **where)


@dataclass(kw_only=True)
class PhysicalTieredCaches(TieredCaches):
    """A :class:`~workbench.kv.tiers_physical.PhysicalTieredKVCache` per sequence over ``store``, its
    routed blocks fetched through ``prefetcher`` (one, shared by the engine's sequences)."""

    store: TierStore
    prefetcher: Prefetcher

    def __post_init__(self) -> None:
        self._new(1).release()                           # validate now; the probe's records go

    def _new(self, max_len: int, **where):
        return PhysicalTieredKVCache(self.config, self.tiers, self.basis, store=self.store,
                                     prefetcher=self.prefetcher, max_len=max_len, **where)

    def finish(self, cache) -> None:
        cache.finish()                 # predicted copies cancelled, staging freed

    def release(self, cache) -> None:
        cache.release()                # its offload records and staging go
