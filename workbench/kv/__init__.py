"""The KV-cache layer.

* bookkeeping, pure Python: ``block_manager`` (paged blocks, ref counts, eviction, copy-on-write),
  ``prefix_cache`` (hash chain, verification, miss reasons), ``layout`` (byte accounting);
* storage: ``paged`` (the pool's tensors, its lifecycle, a sequence's view), ``batch`` (a packed
  step's view over the pool or over per-sequence caches), ``offload``
  (host / disk tier for evicted blocks);
* tiers: ``tier_config`` (zones and bytes), ``pca`` (key bases), ``tiers`` (the hot / warm /
  cold cache and its attention);
* ``inspect``: looking inside (pool and tier reports, live or from a server).

Its quality sweeps and benchmarks are in ``workbench.bench`` (``tier_eval``, ``prefix``).
"""

from workbench._exports import lazy

_EXPORTS = {
    "AllocStatus": "workbench.kv.block_manager",
    "Allocation": "workbench.kv.block_manager",
    "Block": "workbench.kv.block_manager",
    "BlockManager": "workbench.kv.block_manager",
    "KVStats": "workbench.kv.block_manager",
    "KVLayout": "workbench.kv.layout",
    "dtype_bytes": "workbench.kv.layout",
    "MissReason": "workbench.kv.prefix_cache",
    "PrefixCache": "workbench.kv.prefix_cache",
    "block_hash": "workbench.kv.prefix_cache",
    "TierConfig": "workbench.kv.tier_config",
    "ZoneCounts": "workbench.kv.tier_config",
    "basis_bytes": "workbench.kv.tier_config",
    "full_bytes_per_token": "workbench.kv.tier_config",
    "resident_bytes": "workbench.kv.tier_config",
    "zone_counts": "workbench.kv.tier_config",
    "zone_masks": "workbench.kv.tier_config",
    "TieredKVCache": "workbench.kv.tiers",
    "apply_tiered_attention": "workbench.kv.tiers",
    "is_tiered": "workbench.kv.tiers",
    "remove_tiered_attention": "workbench.kv.tiers",
    "tiered_attention": "workbench.kv.tiers",
    "PCABasis": "workbench.kv.pca",
    "KeyRecorder": "workbench.kv.pca",
    "collect_keys": "workbench.kv.pca",
    "fit_pca_basis": "workbench.kv.pca",
    "fit_pca_from_model": "workbench.kv.pca",
    "PagedKVConfig": "workbench.kv.paged",
    "PagedKVPool": "workbench.kv.paged",
    "PagedSequenceCache": "workbench.kv.paged",
    "PoolBlocks": "workbench.kv.paged",
    "PagedBatchCache": "workbench.kv.batch",
    "SequenceBatchCache": "workbench.kv.batch",
    "DiskOffload": "workbench.kv.offload",
    "HostOffload": "workbench.kv.offload",
    "OffloadStore": "workbench.kv.offload",
}
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
