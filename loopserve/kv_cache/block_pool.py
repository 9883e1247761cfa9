"""One physical pool of KV blocks: a free list and reference counts (no tensors here)."""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Hands out block ids; a block returns to the free list when its refcount drops to 0.

    The free list is FIFO so a just-freed block is reused last, which keeps use-after-free
    bugs visible in tests instead of hiding them behind immediate reuse.
    """

    def __init__(self, name: str, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"{name}: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._refcount = [0] * num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise NoFreeBlocksError(f"{self.name} pool: need {n} blocks, {len(self._free)} free")
        ids = [self._free.popleft() for _ in range(n)]
        for b in ids:
            self._refcount[b] = 1
        return ids

    def incref(self, ids: list[int]) -> None:
        for b in ids:
            if self._refcount[b] <= 0:
                raise RuntimeError(f"{self.name} pool: incref of free block {b}")
            self._refcount[b] += 1

    def free(self, ids: list[int]) -> None:
        for b in ids:
            rc = self._refcount[b] - 1
            if rc < 0:
                raise RuntimeError(f"{self.name} pool: block {b} freed more often than allocated")
            self._refcount[b] = rc
            if rc == 0:
                self._free.append(b)

    def refcount(self, block_id: int) -> int:
        return self._refcount[block_id]

    def check(self) -> None:
        """Pool accounting: free + used == total, free blocks have refcount 0, no duplicates."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"{self.name} pool: duplicate ids in the free list")
        in_use = sum(1 for rc in self._refcount if rc > 0)
        if any(rc < 0 for rc in self._refcount):
            raise AssertionError(f"{self.name} pool: negative refcount")
        if any(self._refcount[b] != 0 for b in free):
            raise AssertionError(f"{self.name} pool: a free block has a nonzero refcount")
        if in_use + len(free) != self.num_blocks:
            raise AssertionError(
                f"{self.name} pool: {len(free)} free + {in_use} used != {self.num_blocks} total"
            )
