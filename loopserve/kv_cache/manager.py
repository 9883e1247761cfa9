"""Per-request block tables over the looped and flat pools (pure Python, no torch)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from loopserve.intmath import cdiv
from loopserve.kv_cache.block_pool import BlockPool
from loopserve.kv_cache.block_table import BlockTable, KVLayout
from loopserve.kv_cache.prefix_cache import BlockHash, CachedBlock, PrefixCache


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


@dataclass
class PrefixStats:
    """Prompt tokens looked up in the prefix cache at admission, and those found cached."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    """Allocates every plane of a request together, so all planes cover the same positions.

    With `incremental=False` (full reservation) a request is allocated once for its whole
    lifetime; growing it again is a bug and raises. With `incremental=True` tables grow as
    the scheduler asks. A new table may start with cached prefix blocks (`prefix`), shared
    with other tables by reference count; `cache_blocks` indexes a table's finished prompt
    blocks. Unreferenced cached blocks count as free: allocation evicts them (after plain free
    blocks), least recently freed first.
    """

    def __init__(self, layout: KVLayout, incremental: bool = False) -> None:
        self.layout = layout
        self.incremental = incremental
        self.looped = BlockPool("looped", layout.num_blocks)
        self.flat = BlockPool("flat", layout.num_flat_blocks if layout.has_flat else 0)
        self.prefix = PrefixCache()
        self.prefix_stats = PrefixStats()
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

    def cached_prefix(self, keys: Sequence[BlockHash], prompt_len: int) -> list[CachedBlock]:
        """Cached blocks a new request with these block keys can start from. The prompt's last
        token is never among them: it must run to give the first token's logits."""
        return self.prefix.lookup(keys[:(prompt_len - 1) // self.layout.block_size])

    def shortfall(self, request_id: str, num_tokens: int, num_planes: int,
                  prefix: Sequence[CachedBlock] = ()) -> tuple[int, int]:
        """(looped, flat) blocks missing now for the request to cover `num_tokens` positions,
        starting from `prefix` if it has no table yet (<= 0: none missing)."""
        need_l, need_f = self.blocks_needed(num_tokens, num_planes)
        have_l, have_f = self.blocks_needed(self.capacity(request_id), num_planes)
        taken_l, taken_f = self._taken_from_free(prefix)
        hit_l, hit_f = self.blocks_needed(len(prefix) * self.layout.block_size, num_planes)
        return (max(0, need_l - have_l - hit_l) - (self.looped.num_free - taken_l),
                max(0, need_f - have_f - hit_f) - (self.flat.num_free - taken_f))

    def _taken_from_free(self, prefix: Sequence[CachedBlock]) -> tuple[int, int]:
        """Blocks of `prefix` that sit unreferenced in the free queue (a hit takes them out)."""
        looped = sum(len(e.looped) for e in prefix if self.looped.refs(e.looped[0]) == 0)
        flat = sum(1 for e in prefix if e.flat is not None and self.flat.refs(e.flat) == 0)
        return looped, flat

    def allocate(self, request_id: str, num_tokens: int, num_planes: int,
                 prefix: Sequence[CachedBlock] = ()) -> bool:
        """Grow `request_id`'s planes to cover `num_tokens` positions, a new table starting
        with the shared `prefix` blocks; False (nothing changes) if blocks are short now."""
        if num_planes < 1:
            raise ValueError(f"num_planes must be >= 1, got {num_planes}")
        self.check_fits(request_id, num_tokens, num_planes)
        table = self._tables.get(request_id)
        if prefix and (table is not None or len(prefix) * self.layout.block_size > num_tokens):
            raise ValueError(f"request {request_id!r}: a cached prefix starts a new table within "
                             f"{num_tokens} tokens")
        if any(len(e.looped) != num_planes for e in prefix):
            raise ValueError(f"request {request_id!r}: a cached block's planes differ from its {num_planes}")
        if table is not None:
            if table.num_planes != num_planes:
                raise ValueError(
                    f"request {request_id!r} has {table.num_planes} planes, asked for {num_planes}"
                )
            if not self.incremental and num_tokens > self.capacity(request_id):
                raise RuntimeError(
                    f"request {request_id!r} was fully reserved; growing it is not allowed"
                )
        if max(self.shortfall(request_id, num_tokens, num_planes, prefix)) > 0:
            return False
        have = table.num_logical_blocks() if table is not None else 0
        grow = cdiv(num_tokens, self.layout.block_size) - have - len(prefix)
        if grow <= 0 and not prefix:
            return True
        if table is None:
            table = self._tables[request_id] = BlockTable([], [[] for _ in range(num_planes)])
        for e in prefix:  # shared first, so allocating below cannot evict them
            self.looped.share(list(e.looped))
            for plane, b in zip(table.depth, e.looped):
                plane.append(b)
            if e.flat is not None:
                self.flat.share([e.flat])
                table.flat.append(e.flat)
        if grow <= 0:
            return True
        # Every plane's blocks in one draw, sorted, then dealt round robin (block i of plane k
        # is the (i * planes + k)-th): the same blocks as drawing plane by plane, but the first
        # n blocks of every plane are one run of adjacent ids, whatever n. A handoff READ covers
        # the prompt's blocks of every plane, and the two sides' tables differ in length (the
        # decode side holds room for the next token): dealt plane by plane, each plane was a
        # run of its own and the READ one NIXL descriptor per plane; dealt round robin on both
        # sides, one descriptor per allocation. (Unsorted, a pool past its first cycle dealt
        # ids stepping down: one descriptor per block, one indexed zeroing kernel per request.)
        planes = len(table.depth)
        new_looped = sorted(self.looped.allocate(grow * planes))
        for k, plane in enumerate(table.depth):
            plane.extend(new_looped[k::planes])
        new_flat = sorted(self.flat.allocate(grow)) if self.layout.has_flat else []
        table.flat.extend(new_flat)
        self.prefix.evict(new_looped, new_flat)
        self._new_looped.extend(new_looped)
        self._new_flat.extend(new_flat)
        return True

    def cache_blocks(self, request_id: str, keys: Sequence[BlockHash], start: int) -> None:
        """Index the request's logical blocks `start..len(keys)-1` under `keys[i]` (their K/V is
        complete on every plane). A key cached already (by another request) keeps its entry."""
        table = self._tables[request_id]
        for i in range(start, len(keys)):
            flat = table.flat[i] if self.layout.has_flat else None
            self.prefix.insert(keys[i], CachedBlock(tuple(p[i] for p in table.depth), flat))

    def exclusive_blocks(self, request_id: str) -> tuple[int, int]:
        """(looped, flat) blocks that freeing the request would unreference (others share the rest)."""
        t = self._tables[request_id]
        return (sum(1 for p in t.depth for b in p if self.looped.refs(b) == 1),
                sum(1 for b in t.flat if self.flat.refs(b) == 1))

    def capacity(self, request_id: str) -> int:
        """Positions the request's planes currently cover."""
        table = self._tables.get(request_id)
        return 0 if table is None else table.num_logical_blocks() * self.layout.block_size

    def free(self, request_id: str) -> bool:
        table = self._tables.pop(request_id, None)
        if table is None:
            return False
        # Last block first: a request's tail blocks are evicted before the prefix they extend.
        for i in reversed(range(table.num_logical_blocks())):
            cached = self.prefix.is_cached(table.depth[0][i])
            self.looped.free([p[i] for p in table.depth], cached)
            if table.flat:
                self.flat.free([table.flat[i]], cached)
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

    def usage(self) -> KVUsage:
        def pool(p: BlockPool) -> PoolUsage:
            return PoolUsage(used=p.num_used, free=p.num_free, total=p.num_blocks)

        per_request = {
            rid: (sum(len(p) for p in t.depth), len(t.flat)) for rid, t in self._tables.items()
        }
        # distinct ids: a prefix-cached block is shared by several tables but held once
        planes: list[set[int]] = [set() for _ in range(max((t.num_planes for t in self._tables.values()),
                                                          default=0))]
        for t in self._tables.values():
            for i, plane in enumerate(t.depth):
                planes[i].update(plane)
        return KVUsage(pool(self.looped), pool(self.flat), per_request, tuple(len(p) for p in planes))

    def check(self) -> None:
        """Pool accounting plus: each block's reference count is the number of tables holding
        it, and cached blocks are valid ids."""
        self.looped.check()
        self.flat.check()
        for name, pool, owned in (
            ("looped", self.looped, Counter(b for t in self._tables.values() for p in t.depth for b in p)),
            ("flat", self.flat, Counter(b for t in self._tables.values() for b in t.flat)),
        ):
            wrong = [b for b in range(pool.num_blocks) if pool.refs(b) != owned.get(b, 0)]
            if wrong:
                b = wrong[0]
                raise AssertionError(f"{name} pool: block {b} has {pool.refs(b)} references, "
                                     f"tables hold it {owned.get(b, 0)} times")
        looped, flat = self.prefix.blocks()
        if not all(0 <= b < self.looped.num_blocks for b in looped) or \
                not all(0 <= b < self.flat.num_blocks for b in flat):
            raise AssertionError("prefix cache indexes a block outside its pool")
