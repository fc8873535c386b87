"""The KV-cache layer.

* bookkeeping, pure Python: ``block_manager`` (paged blocks, ref counts, eviction, copy-on-write),
  ``prefix_cache`` (hash chain, verification, miss reasons), ``layout`` (byte accounting);
* storage: ``paged`` (the pool's tensors, its lifecycle, a sequence's view), ``batch`` (a packed
  step's view over the pool or over per-sequence caches), ``offload``
  (host / disk tier for evicted blocks);
* tiers: ``tier_config`` (zones and bytes), ``pca`` (key bases), ``tiers`` (the hot / warm /
  cold cache and its attention), ``tier_eval`` (perplexity / KL / top-1 sweeps, Pareto front);
* ``prefix_bench`` and ``inspect``: measuring and looking inside.
"""

from .block_manager import AllocStatus, Allocation, Block, BlockManager, KVStats
from .layout import KVLayout, dtype_bytes
from .prefix_cache import MissReason, PrefixCache, block_hash
from .tier_config import (TierConfig, ZoneCounts, basis_bytes, full_bytes_per_token, resident_bytes,
                          zone_counts, zone_masks)
from .tiers import TieredKVCache, apply_tiered_attention, is_tiered, remove_tiered_attention, tiered_attention
from .pca import PCABasis, KeyRecorder, collect_keys, fit_pca_basis, fit_pca_from_model
from .tier_eval import (best_under, check_sequential, evaluate_config, grid_configs, heldout_split,
                        pareto_figure, pareto_front, sweep)
from .paged import PagedKVConfig, PagedKVPool, PagedSequenceCache, PoolBlocks
from .batch import PagedBatchCache, SequenceBatchCache
from .offload import DiskOffload, HostOffload, OffloadStore
