"""A request's depth-aware block table and the KV pool layout it indexes."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVLayout:
    """Shape of the two pools: looped (one plane per loop depth) and flat (non-looped layers)."""

    block_size: int
    num_blocks: int
    num_flat_blocks: int = 0
    has_flat: bool = False

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.has_flat and self.num_flat_blocks < 1:
            raise ValueError(
                f"num_flat_blocks must be >= 1 when the model has non-looped layers, "
                f"got {self.num_flat_blocks}"
            )


@dataclass
class BlockTable:
    """`flat` holds the non-looped layers' blocks; `depth[d-1]` the looped layers' at depth d."""

    flat: list[int] = field(default_factory=list)
    depth: list[list[int]] = field(default_factory=list)

    @property
    def num_planes(self) -> int:
        return len(self.depth)

    def num_logical_blocks(self) -> int:
        return len(self.depth[0]) if self.depth else len(self.flat)

    def copy(self) -> BlockTable:
        return BlockTable(list(self.flat), [list(p) for p in self.depth])

    def to_dict(self) -> dict:
        return {"flat": list(self.flat), "depth": [list(p) for p in self.depth]}

    @classmethod
    def from_dict(cls, d: dict) -> BlockTable:
        return cls(list(d["flat"]), [list(p) for p in d["depth"]])
