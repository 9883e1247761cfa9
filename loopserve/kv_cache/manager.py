"""Per-request block tables over the looped and flat pools (pure Python, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from loopserve.intmath import cdiv
from loopserve.kv_cache.block_pool import BlockPool
from loopserve.kv_cache.block_table import BlockTable, KVLayout


class KVCapacityError(ValueError):
    """The request can never fit in the pools, however many others finish."""


@dataclass(frozen=True)
class PoolUsage:
    used: int
    free: int
    total: int


@dataclass(frozen=True)
class KVUsage:
    looped: PoolUsage
    flat: PoolUsage
    per_request: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Looped blocks held in each plane (index = plane: one per loop, or one shared): where
    # the looped pool goes, since requests of different loop counts share it.
    planes: tuple[int, ...] = ()

    @property
    def used_blocks(self) -> int:
        return self.looped.used + self.flat.used


class KVCacheManager:
    """Allocates every plane of a request together, so all planes cover the same positions.

    With `incremental=False` (full reservation) a request is allocated once for its whole
    lifetime; growing it again is a bug and raises. With `incremental=True` tables grow as
    the scheduler asks.
    """

    def __init__(self, layout: KVLayout, incremental: bool = False) -> None:
        self.layout = layout
        self.incremental = incremental
        self.looped = BlockPool("looped", layout.num_blocks)
        self.flat = BlockPool("flat", layout.num_flat_blocks if layout.has_flat else 0)
        self._tables: dict[str, BlockTable] = {}
        self._new_looped: list[int] = []
        self._new_flat: list[int] = []

    def blocks_needed(self, num_tokens: int, num_planes: int) -> tuple[int, int]:
        n = cdiv(num_tokens, self.layout.block_size)
        return n * num_planes, (n if self.layout.has_flat else 0)

    def check_fits(self, request_id: str, num_tokens: int, num_planes: int) -> None:
        """KVCapacityError naming the pool setting (num_blocks, num_flat_blocks) and its size
        when the request can never fit, however many others finish."""
        looped, flat = self.blocks_needed(num_tokens, num_planes)
        over = []
        if looped > self.looped.num_blocks:
            over.append(f"{looped} looped KV blocks ({num_tokens} tokens x {num_planes} KV planes), "
                        f"more than num_blocks ({self.looped.num_blocks})")
        if flat > self.flat.num_blocks:
            over.append(f"{flat} flat KV blocks ({num_tokens} tokens), more than num_flat_blocks "
                        f"({self.flat.num_blocks})")
        if over:
            raise KVCapacityError(f"request {request_id!r} needs {' and '.join(over)}; "
                                  f"block_size {self.layout.block_size}")

    def allocate(self, request_id: str, num_tokens: int, num_planes: int) -> bool:
        """Grow `request_id`'s planes to cover `num_tokens` positions; False if blocks are short now."""
        if num_planes < 1:
            raise ValueError(f"num_planes must be >= 1, got {num_planes}")
        self.check_fits(request_id, num_tokens, num_planes)
        table = self._tables.get(request_id)
        if table is not None:
            if table.num_planes != num_planes:
                raise ValueError(
                    f"request {request_id!r} has {table.num_planes} planes, asked for {num_planes}"
                )
            if not self.incremental and num_tokens > self.capacity(request_id):
                raise RuntimeError(
                    f"request {request_id!r} was fully reserved; growing it is not allowed"
                )
        have = table.num_logical_blocks() if table is not None else 0
        grow = cdiv(num_tokens, self.layout.block_size) - have
        if grow <= 0:
            return True
        need_flat = grow if self.layout.has_flat else 0
        if grow * num_planes > self.looped.num_free or need_flat > self.flat.num_free:
            return False
        if table is None:
            table = self._tables[request_id] = BlockTable([], [[] for _ in range(num_planes)])
        for plane in table.depth:
            ids = self.looped.allocate(grow)
            plane.extend(ids)
            self._new_looped.extend(ids)
        if need_flat:
            ids = self.flat.allocate(need_flat)
            table.flat.extend(ids)
            self._new_flat.extend(ids)
        return True

    def capacity(self, request_id: str) -> int:
        """Positions the request's planes currently cover."""
        table = self._tables.get(request_id)
        return 0 if table is None else table.num_logical_blocks() * self.layout.block_size

    def free(self, request_id: str) -> bool:
        table = self._tables.pop(request_id, None)
        if table is None:
            return False
        for plane in table.depth:
            self.looped.free(plane)
        self.flat.free(table.flat)
        return True

    def has(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> BlockTable:
        return self._tables[request_id]

    def pop_new_blocks(self) -> tuple[list[int], list[int]]:
        """Blocks allocated since the last call; the engine zeroes them before first use."""
        looped, flat = self._new_looped, self._new_flat
        self._new_looped, self._new_flat = [], []
        return looped, flat

    def num_free_blocks(self) -> tuple[int, int]:
        return self.looped.num_free, self.flat.num_free

    def usage(self) -> KVUsage:
        def pool(p: BlockPool) -> PoolUsage:
            return PoolUsage(used=p.num_used, free=p.num_free, total=p.num_blocks)

        per_request = {
            rid: (sum(len(p) for p in t.depth), len(t.flat)) for rid, t in self._tables.items()
        }
        planes = [0] * max((t.num_planes for t in self._tables.values()), default=0)
        for t in self._tables.values():
            for i, plane in enumerate(t.depth):
                planes[i] += len(plane)
        return KVUsage(pool(self.looped), pool(self.flat), per_request, tuple(planes))

    def check(self) -> None:
        """Pool accounting plus: the tables own exactly the used blocks."""
        self.looped.check()
        self.flat.check()
        owned_looped = [b for t in self._tables.values() for p in t.depth for b in p]
        owned_flat = [b for t in self._tables.values() for b in t.flat]
        if len(owned_looped) != self.looped.num_used or len(set(owned_looped)) != len(owned_looped):
            raise AssertionError(
                f"looped pool: tables own {len(owned_looped)} blocks, pool says {self.looped.num_used} used"
            )
        if len(owned_flat) != self.flat.num_used or len(set(owned_flat)) != len(owned_flat):
            raise AssertionError(
                f"flat pool: tables own {len(owned_flat)} blocks, pool says {self.flat.num_used} used"
            )
