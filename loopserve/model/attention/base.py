"""The attention backend interface (see docs/design.md for the semantics)."""

from __future__ import annotations

from typing import Protocol

import torch

from loopserve.model.batch import AttnMetadata
from loopserve.model.layers import Rotation
from loopserve.model.paged_kv import dequantize, quantize


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttnMetadata, scale: float, window: int | None = None,
                rot: Rotation | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate q and k by `rot` (if given), write k, v at meta.slot_mapping into `cache`,
        then attend. (Backends may fuse the rotation into the write.)

        q [T, Hq, D]; k, v [T, Hkv, D]; cache [num_blocks, 2, block_size, Hkv, D] (a strided view);
        a row at position p attends to positions max(0, p - window + 1)..p of its plane.
        kv_scale: [2] fp32 (k_scale, v_scale) of an FP8 cache (quantize on the write,
        dequantize on the read: paged_kv.quantize / dequantize); None for the model dtype.
        """
        ...


def stored(x: torch.Tensor, cache_dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """x as the cache holds it (rounded to its storage), back in x's dtype."""
    if scale is None:
        return x.to(cache_dtype).to(x.dtype)
    return dequantize(quantize(x, scale), scale, x.dtype)


def write_kv(cache: torch.Tensor, meta: AttnMetadata, k: torch.Tensor, v: torch.Tensor,
             kv_scale: torch.Tensor | None = None) -> None:
    """Rows with slot -1 (padding of a CUDA-graph batch) write nothing."""
    bs, slots = meta.block_size, meta.slot_mapping
    keep = slots >= 0
    if not bool(keep.all()):
        slots, k, v = slots[keep], k[keep], v[keep]
    blk, off = slots // bs, slots % bs
    if kv_scale is None:
        cache[blk, 0, off] = k.to(cache.dtype)
        cache[blk, 1, off] = v.to(cache.dtype)
    else:
        cache[blk, 0, off] = quantize(k, kv_scale[0])
        cache[blk, 1, off] = quantize(v, kv_scale[1])
