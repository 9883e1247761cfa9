"""Triton slot write: k, v rows -> their slots in a strided paged cache view, in one launch.

`write_kv` (torch) needs two index_put launches plus the div/mod of the slot mapping; this
does all of it in one program per row, for any strides of the block-major pool view. Rows
with slot -1 (padding of a CUDA-graph batch) write nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loopserve.model.batch import AttnMetadata


@triton.jit
def _write_kv_kernel(K, V, Cache, Slots,
                     sk_t, sk_h, sk_d, sv_t, sv_h, sv_d,
                     sc_blk, sc_kv, sc_off, sc_h, sc_d,
                     HKV: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    live = (h < HKV) & ((h * 0 + slot) >= 0)  # slot -1: a padding row
    mask = live[:, None] & (d < HEAD_D)[None, :]
    dst = Cache + (slot // PAGE) * sc_blk + (slot % PAGE) * sc_off + h[:, None] * sc_h + d[None, :] * sc_d
    k = tl.load(K + t * sk_t + h[:, None] * sk_h + d[None, :] * sk_d, mask=mask)
    v = tl.load(V + t * sv_t + h[:, None] * sv_h + d[None, :] * sv_d, mask=mask)
    tl.store(dst, k.to(Cache.dtype.element_ty), mask=mask)
    tl.store(dst + sc_kv, v.to(Cache.dtype.element_ty), mask=mask)


def triton_write_kv(cache: torch.Tensor, meta: AttnMetadata, k: torch.Tensor, v: torch.Tensor) -> None:
    """Same effect as `attention.base.write_kv`; shapes are checked by the caller."""
    num_rows, hkv, head_d = k.shape
    if num_rows == 0:
        return
    _write_kv_kernel[(num_rows,)](
        k, v, cache, meta.slot_mapping, *k.stride(), *v.stride(), *cache.stride(),
        HKV=hkv, HEAD_D=head_d, PAGE=meta.block_size,
        BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(head_d))
