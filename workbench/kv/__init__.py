"""The KV-cache layer.

* bookkeeping, pure Python: ``block_manager`` (paged blocks, ref counts, eviction, copy-on-write),
  ``prefix_cache`` (hash chain, verification, miss reasons), ``layout`` (byte accounting),
  ``interface`` (``KVManager``: the block calls a scheduler makes);
* storage: ``paged`` (the pool's tensors, its lifecycle, a sequence's view), ``batch`` (a packed
  step's view over the pool or over per-sequence caches), ``offload``
  (host / disk tier for evicted blocks, through the prefetch layer's transports), ``kv_prefetch``
  (the lookahead that stages offloaded prefix blocks and swapped-out KV ahead of their use);
* tiers: ``tier_config`` (zones and bytes), ``pca`` (key bases), ``tier_attention`` (the
  arithmetic both tiered caches share), ``tiers`` (the accounted hot / warm / cold cache: a full
  copy kept, bytes by formula), ``tiers_physical`` (only the resident zones kept, blocks in an
  offload tier, routed blocks fetched back through the prefetcher; bytes measured) with
  ``tier_store`` (its offload tier and predictor) and ``tier_blocks`` (its offloaded blocks);
* ``inspect``: looking inside (pool and tier reports, live or from a server).

Its quality sweeps and benchmarks are in ``workbench.bench`` (``tier_eval``, ``prefix``).
"""

from workbench._exports import exports, lazy

_EXPORTS = exports({
    "workbench.kv.block_manager": "AllocStatus Allocation Block BlockManager KVStats",
    "workbench.kv.interface": "KVManager PrefixMatch",
    "workbench.kv.layout": "KVLayout dtype_bytes",
    "workbench.kv.prefix_cache": "MissReason PrefixCache block_hash",
    "workbench.kv.tier_config": ("TierConfig ZoneCounts basis_bytes full_bytes_per_token resident_bytes zone_bytes "
                                 "zone_counts zone_masks"),
    "workbench.kv.tiers_physical": "PhysicalTieredKVCache",
    "workbench.kv.tier_store": "TierStore",
    "workbench.kv.tiers": "TieredKVCache apply_tiered_attention is_tiered remove_tiered_attention tiered_attention",
    "workbench.kv.pca": "PCABasis KeyRecorder collect_keys fit_pca_basis fit_pca_from_model",
    "workbench.kv.paged": "PagedKVConfig PagedKVPool PagedSequenceCache PoolBlocks",
    "workbench.kv.batch": "PagedBatchCache SequenceBatchCache",
    "workbench.kv.offload": "DiskOffload HostOffload OffloadStats OffloadStore Staging",
    "workbench.kv.kv_prefetch": "KVPrefetch SwapStore make_tiers offloaded_prefix",
})
__all__ = list(_EXPORTS)
__getattr__, __dir__ = lazy(__name__, _EXPORTS)
