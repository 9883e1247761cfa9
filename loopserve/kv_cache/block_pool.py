"""One physical pool of KV blocks: reference counts and a free queue (no tensors here).

A block is shared by every request whose table holds it (prefix caching), so each block
carries a reference count; it becomes free when the count drops to zero. A free block the
prefix cache still indexes waits in a second queue, valid until it is handed out again:
plain free blocks go first, then cached ones, least recently freed first (LRU eviction).
"""

from __future__ import annotations

from collections import OrderedDict


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Hands out block ids; a block whose last reference goes joins the end of its queue.

    The plain queue is FIFO, so a just-freed block is reused last, which keeps use-after-free
    bugs visible in tests instead of hiding them behind immediate reuse.
    """

    def __init__(self, name: str, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"{name}: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: OrderedDict[int, None] = OrderedDict()  # free but indexed: LRU first
        self._refs = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._cached)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def refs(self, block: int) -> int:
        return self._refs[block]

    def allocate(self, n: int) -> list[int]:
        """`n` blocks, plain ones first, one reference each (the caller drops the cache entries
        of any cached block among them)."""
        if n > self.num_free:
            raise NoFreeBlocksError(f"{self.name} pool: need {n} blocks, {self.num_free} free")
        ids = [(self._free if self._free else self._cached).popitem(last=False)[0] for _ in range(n)]
        for b in ids:
            self._refs[b] = 1
        return ids

    def share(self, ids: list[int]) -> None:
        """One more reference to each block (a prefix-cache hit); a free one leaves the queue."""
        for b in ids:
            if self._refs[b] == 0:
                (self._cached if b in self._cached else self._free).pop(b)
            self._refs[b] += 1

    def free(self, ids: list[int], cached: bool = False) -> None:
        """Drop one reference to each block, in order; unreferenced blocks join the plain queue,
        or the LRU one if the prefix cache indexes them (`cached`)."""
        queue = self._cached if cached else self._free
        for b in ids:
            if self._refs[b] == 0:
                raise RuntimeError(f"{self.name} pool: block {b} freed more often than allocated")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                queue[b] = None

    def check(self) -> None:
        """Pool accounting: a block is queued (once) iff unreferenced; free + used == total."""
        bad = [b for q in (self._free, self._cached) for b in q if self._refs[b]]
        if bad:
            raise AssertionError(f"{self.name} pool: free blocks {bad[:5]} are referenced")
        if self._free.keys() & self._cached.keys():
            raise AssertionError(f"{self.name} pool: a block is in both free queues")
        used = sum(1 for r in self._refs if r)
        if used + self.num_free != self.num_blocks:
            raise AssertionError(
                f"{self.name} pool: {self.num_free} free + {used} used != {self.num_blocks} total"
            )
