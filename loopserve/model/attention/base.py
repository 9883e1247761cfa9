"""The attention backend interface (see docs/design.md for the semantics)."""

from __future__ import annotations

from typing import Protocol

import torch

from loopserve.model.batch import AttnMetadata
from loopserve.model.layers import Rotation


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttnMetadata, scale: float, window: int | None = None,
                rot: Rotation | None = None) -> torch.Tensor:
        """Rotate q and k by `rot` (if given), write k, v at meta.slot_mapping into `cache`,
        then attend. (Backends may fuse the rotation into the write.)

        q [T, Hq, D]; k, v [T, Hkv, D]; cache [num_blocks, 2, block_size, Hkv, D] (a strided view);
        a row at position p attends to positions max(0, p - window + 1)..p of its plane.
        """
        ...


def write_kv(cache: torch.Tensor, meta: AttnMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
    """Rows with slot -1 (padding of a CUDA-graph batch) write nothing."""
    bs, slots = meta.block_size, meta.slot_mapping
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    blk, off = slots // bs, slots % bs
    cache[blk, 0, off] = k.to(cache.dtype)
    cache[blk, 1, off] = v.to(cache.dtype)
