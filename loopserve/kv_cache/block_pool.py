"""One physical pool of KV blocks: reference counts and a free queue (no tensors here).

A block is shared by every request whose table holds it (prefix caching), so each block
carries a reference count; it joins the free queue when the count drops to zero. A freed
block that the prefix cache still indexes stays valid in the queue until it is handed out
again, so the queue's order is also the cache's LRU eviction order.
"""

from __future__ import annotations

from collections import OrderedDict


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Hands out block ids; a block whose last reference goes joins the end of the queue.

    The queue is FIFO, so a just-freed block is reused last: use-after-free bugs stay visible
    in tests, and cached blocks freed long ago are evicted first (LRU).
    """

    def __init__(self, name: str, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"{name}: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def refs(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """`n` blocks from the head of the queue, one reference each (the caller drops any
        cache entry they still held)."""
        if n > len(self._free):
            raise NoFreeBlocksError(f"{self.name} pool: need {n} blocks, {len(self._free)} free")
        ids = [self._free.popitem(last=False)[0] for _ in range(n)]
        for b in ids:
            self._refs[b] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        """One more reference to each block (a prefix-cache hit); a free one leaves the queue."""
        for b in ids:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1

    def free(self, ids: list[int]) -> None:
        """Drop one reference to each block, in order; unreferenced blocks join the queue."""
        for b in ids:
            if self._refs[b] == 0:
                raise RuntimeError(f"{self.name} pool: block {b} freed more often than allocated")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None

    def check(self) -> None:
        """Pool accounting: a block is queued iff unreferenced; free + used == total."""
        bad = [b for b in self._free if self._refs[b]]
        if bad:
            raise AssertionError(f"{self.name} pool: free blocks {bad[:5]} are referenced")
        used = sum(1 for r in self._refs if r)
        if used + len(self._free) != self.num_blocks:
            raise AssertionError(
                f"{self.name} pool: {len(self._free)} free + {used} used != {self.num_blocks} total"
            )
