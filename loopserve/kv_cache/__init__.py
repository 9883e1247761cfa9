"""Depth-aware KV block accounting (pure Python: the scheduler imports it, never torch)."""

from loopserve.kv_cache.block_pool import BlockPool, NoFreeBlocksError
from loopserve.kv_cache.block_table import BlockTable, KVLayout
from loopserve.kv_cache.manager import KVCacheManager, KVCapacityError, KVUsage, PoolUsage, PrefixStats
from loopserve.kv_cache.prefix_cache import BlockHash, CacheEvents, CachedBlock, PrefixCache, hash_blocks

__all__ = [
    "BlockHash",
    "BlockPool",
    "BlockTable",
    "CacheEvents",
    "CachedBlock",
    "KVCacheManager",
    "KVCapacityError",
    "KVLayout",
    "KVUsage",
    "NoFreeBlocksError",
    "PoolUsage",
    "PrefixCache",
    "PrefixStats",
    "hash_blocks",
]
