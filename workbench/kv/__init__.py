"""Paged KV cache: block bookkeeping, prefix cache and byte layout (pure Python here)."""

from .block_manager import AllocStatus, Allocation, Block, BlockManager, KVStats
from .layout import KVLayout, dtype_bytes
from .prefix_cache import MissReason, PrefixCache, block_hash
