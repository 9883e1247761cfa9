"""Depth-aware KV block accounting (pure Python: the scheduler imports it, never torch)."""

from loopserve.kv_cache.block_pool import BlockPool, NoFreeBlocksError
from loopserve.kv_cache.block_table import BlockTable, KVLayout
from loopserve.kv_cache.manager import KVCacheManager, KVCapacityError, KVUsage, PoolUsage

__all__ = [
    "BlockPool",
    "BlockTable",
    "KVCacheManager",
    "KVCapacityError",
    "KVLayout",
    "KVUsage",
    "NoFreeBlocksError",
    "PoolUsage",
]
