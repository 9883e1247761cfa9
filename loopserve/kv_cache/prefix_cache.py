"""Prefix caching: full prompt blocks indexed by a hash chain, shared on every plane.

A block's key hashes (parent block's key, the block's token ids, the request's cache key),
so equal keys mean equal prefixes up to and including the block. The cache key holds what
else a prompt token's K/V depends on: the model and its loop configuration (min/max loops,
exit threshold, planes) and, for a model whose initial state is seeded, the seed. One entry
is one logical block: its block on every looped plane and its flat block, reused together.
Blocks live in the pools (block_pool.py); an entry lasts until one of its blocks is handed
out again. Once asked to (`record_events`), the cache also records what it stores and drops,
for a router to index which worker holds which prefix (vLLM's and Dynamo's KV events).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

BlockHash = bytes


def hash_blocks(token_ids: Sequence[int], block_size: int, cache_key: Hashable) -> tuple[BlockHash, ...]:
    """The chain of keys of the full blocks of `token_ids` (stable across processes, so a
    router or a peer engine can compute the same keys)."""
    extra = repr(cache_key).encode()
    out: list[BlockHash] = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("q", token_ids[start:start + block_size]).tobytes())
        h.update(extra)
        parent = h.digest()
        out.append(parent)
    return tuple(out)


@dataclass(frozen=True)
class CachedBlock:
    """One logical block's physical blocks: plane 1's first, then the flat block (or None)."""

    looped: tuple[int, ...]
    flat: int | None


@dataclass(frozen=True)
class CacheEvents:
    """Changes since the last take, in order: (True, key) stored, (False, key) dropped. With
    `reset` the reader forgets what it knew; the changes then store every cached key."""

    changes: list[tuple[bool, BlockHash]]
    reset: bool = False


class PrefixCache:
    """Key -> CachedBlock, and block -> key so reusing a block drops its entry."""

    def __init__(self) -> None:
        self._entries: dict[BlockHash, CachedBlock] = {}
        self._looped_key: dict[int, BlockHash] = {}
        self._flat_key: dict[int, BlockHash] = {}
        self.num_evicted = 0  # entries dropped because a block of theirs was handed out again
        self._events: list[tuple[bool, BlockHash]] | None = None  # None: not recorded
        self._snapshot_next = False

    def record_events(self) -> None:
        """Record changes from now on; the next take is a snapshot of everything cached."""
        self._events, self._snapshot_next = [], True

    def take_events(self) -> CacheEvents:
        if self._events is None:
            raise RuntimeError("record_events() first")
        if self._snapshot_next:
            self._events, self._snapshot_next = [], False
            return CacheEvents([(True, k) for k in self._entries], reset=True)
        out, self._events = self._events, []
        return CacheEvents(out)

    def _note(self, stored: bool, key: BlockHash) -> None:
        if self._events is not None and not self._snapshot_next:
            self._events.append((stored, key))

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, keys: Sequence[BlockHash]) -> list[CachedBlock]:
        """Entries of the longest cached prefix of `keys`."""
        hits = []
        for k in keys:
            e = self._entries.get(k)
            if e is None:
                break
            hits.append(e)
        return hits

    def insert(self, key: BlockHash, block: CachedBlock) -> bool:
        """Index `block` under `key`; False (nothing changes) if the key is already cached."""
        if key in self._entries:
            return False
        self._entries[key] = block
        self._note(True, key)
        for b in block.looped:
            self._looped_key[b] = key
        if block.flat is not None:
            self._flat_key[block.flat] = key
        return True

    def is_cached(self, looped_block: int) -> bool:
        return looped_block in self._looped_key

    def evict(self, looped: Sequence[int], flat: Sequence[int]) -> None:
        """Drop the entries holding any of these blocks (they are being handed out anew)."""
        for ids, index in ((looped, self._looped_key), (flat, self._flat_key)):
            for b in ids:
                key = index.get(b)
                if key is not None:
                    self._drop(key)

    def _drop(self, key: BlockHash) -> None:
        self.num_evicted += 1
        e = self._entries.pop(key)
        self._note(False, key)
        for b in e.looped:
            del self._looped_key[b]
        if e.flat is not None:
            del self._flat_key[e.flat]

    def blocks(self) -> tuple[list[int], list[int]]:
        """Every cached (looped, flat) block (for checks)."""
        return list(self._looped_key), list(self._flat_key)
