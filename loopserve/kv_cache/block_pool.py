"""One physical pool of KV blocks: a free list and which blocks are in use (no tensors here).

No block is shared between requests, so a block is either free or owned by one request.
"""

from __future__ import annotations

from collections import deque


class NoFreeBlocksError(RuntimeError):
    pass


class BlockPool:
    """Hands out block ids; a freed block returns to the end of the free list.

    The free list is FIFO so a just-freed block is reused last, which keeps use-after-free
    bugs visible in tests instead of hiding them behind immediate reuse.
    """

    def __init__(self, name: str, num_blocks: int) -> None:
        if num_blocks < 0:
            raise ValueError(f"{name}: num_blocks must be >= 0, got {num_blocks}")
        self.name = name
        self.num_blocks = num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._in_use = [False] * num_blocks

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
            self._in_use[b] = True
        return ids

    def free(self, ids: list[int]) -> None:
        for b in ids:
            if not self._in_use[b]:
                raise RuntimeError(f"{self.name} pool: block {b} freed more often than allocated")
            self._in_use[b] = False
            self._free.append(b)

    def check(self) -> None:
        """Pool accounting: free + used == total, free blocks are not in use, no duplicates."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"{self.name} pool: duplicate ids in the free list")
        if any(self._in_use[b] for b in free):
            raise AssertionError(f"{self.name} pool: a free block is marked in use")
        in_use = sum(self._in_use)
        if in_use + len(free) != self.num_blocks:
            raise AssertionError(
                f"{self.name} pool: {len(free)} free + {in_use} used != {self.num_blocks} total"
            )
