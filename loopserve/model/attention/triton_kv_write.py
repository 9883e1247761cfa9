"""Triton slot write: k, v rows -> their slots in a strided paged cache view, in one launch,
optionally applying RoPE to q and k on the way (one kernel instead of three per layer).

`write_kv` (torch) needs two index_put launches plus the div/mod of the slot mapping; this
does all of it in one program per row, for any strides of the block-major pool view. Rows
with slot -1 (padding of a CUDA-graph batch) write nothing.

With a rotation, each program also rotates its row's q heads (written to a new contiguous
q) and k heads in fp32, rounds them to the input dtype as the torch path does, and writes the
rotated k; at decode batch sizes the two RoPE launches and the write cost more in launches
and gaps than in bytes. An FP8 cache gets k and v quantized by the layer's scales on the way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loopserve.model.attention.triton_paged_attn import kv_scales, to_cache
from loopserve.model.batch import AttnMetadata
from loopserve.model.layers import Rotation


@triton.jit
def _rotated(X, s_h, s_d, h, d, mask, cos, sin, HALF: tl.constexpr, INTERLEAVED: tl.constexpr):
    """Rows h of one token's heads, RoPE-rotated in fp32: x[d]·cos + sign·x[partner]·sin."""
    if INTERLEAVED:  # pairs (2j, 2j+1)
        partner = d ^ 1
        sign = tl.where(d % 2 == 0, -1.0, 1.0)
    else:  # halves (j, j + D/2)
        partner = tl.where(d < HALF, d + HALF, d - HALF)
        sign = tl.where(d < HALF, -1.0, 1.0)
    x = tl.load(X + h[:, None] * s_h + d[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(X + h[:, None] * s_h + partner[None, :] * s_d, mask=mask, other=0.0).to(tl.float32)
    return x * cos[None, :] + sign[None, :] * xp * sin[None, :]


@triton.jit
def _write_kv_kernel(K, V, Cache, KVScale, Slots, Q, QOut, KOut, Cos, Sin,
                     sk_t, sk_h, sk_d, sv_t, sv_h, sv_d, sq_t, sq_h, sq_d, s_cos,
                     sc_blk, sc_kv, sc_off, sc_h, sc_d,
                     HQ: tl.constexpr, HKV: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_HQ: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr, STORE_K: tl.constexpr,
                     KV_FP8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Slots + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_D
    mask = (h < HKV)[:, None] & d_mask[None, :]
    if ROTATE:
        pair = d // 2 if INTERLEAVED else d % (HEAD_D // 2)
        cos = tl.load(Cos + t * s_cos + pair, mask=d_mask, other=0.0)
        sin = tl.load(Sin + t * s_cos + pair, mask=d_mask, other=0.0)
        hq = tl.arange(0, BLOCK_HQ)
        q_mask = (hq < HQ)[:, None] & d_mask[None, :]
        q = _rotated(Q + t * sq_t, sq_h, sq_d, hq, d, q_mask, cos, sin, HEAD_D // 2, INTERLEAVED)
        tl.store(QOut + t * (HQ * HEAD_D) + hq[:, None] * HEAD_D + d[None, :],
                 q.to(QOut.dtype.element_ty), mask=q_mask)
        k = _rotated(K + t * sk_t, sk_h, sk_d, h, d, mask, cos, sin, HEAD_D // 2, INTERLEAVED)
        k = k.to(K.dtype.element_ty)  # what the torch path's rotated k holds
        if STORE_K:
            tl.store(KOut + t * (HKV * HEAD_D) + h[:, None] * HEAD_D + d[None, :], k, mask=mask)
    else:
        k = tl.load(K + t * sk_t + h[:, None] * sk_h + d[None, :] * sk_d, mask=mask)
    v = tl.load(V + t * sv_t + h[:, None] * sv_h + d[None, :] * sv_d, mask=mask)
    live = mask & ((h * 0 + slot) >= 0)[:, None]  # slot -1: a padding row
    dst = Cache + (slot // PAGE) * sc_blk + (slot % PAGE) * sc_off + h[:, None] * sc_h + d[None, :] * sc_d
    k_scale, v_scale = kv_scales(KVScale, KV_FP8)
    tl.store(dst, to_cache(k, k_scale, Cache.dtype.element_ty, KV_FP8), mask=live)
    tl.store(dst + sc_kv, to_cache(v, v_scale, Cache.dtype.element_ty, KV_FP8), mask=live)


def _launch(cache: torch.Tensor, meta: AttnMetadata, k: torch.Tensor, v: torch.Tensor,
            q: torch.Tensor | None, q_out: torch.Tensor | None, k_out: torch.Tensor | None,
            rot: Rotation | None, kv_scale: torch.Tensor | None) -> None:
    num_rows, hkv, head_d = k.shape
    if num_rows == 0:
        return
    hq = q.shape[1] if q is not None else 1
    cos, sin = (rot.cos, rot.sin) if rot is not None else (k, k)  # unused without ROTATE
    qs = q.stride() if q is not None else (0, 0, 0)
    _write_kv_kernel[(num_rows,)](
        k, v, cache, kv_scale if kv_scale is not None else k, meta.slot_mapping,
        q if q is not None else k, q_out if q_out is not None else k, k_out if k_out is not None else k, cos, sin,
        *k.stride(), *v.stride(), *qs, cos.stride(0), *cache.stride(),
        HQ=hq, HKV=hkv, HEAD_D=head_d, PAGE=meta.block_size,
        BLOCK_HQ=triton.next_power_of_2(hq), BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(head_d), ROTATE=rot is not None,
        INTERLEAVED=bool(rot is not None and rot.interleaved), STORE_K=k_out is not None,
        KV_FP8=kv_scale is not None)


def triton_write_kv(cache: torch.Tensor, meta: AttnMetadata, k: torch.Tensor, v: torch.Tensor,
                    kv_scale: torch.Tensor | None = None) -> None:
    """Same effect as `attention.base.write_kv`; shapes are checked by the caller."""
    _launch(cache, meta, k, v, None, None, None, None, kv_scale)


def triton_rope_write_kv(cache: torch.Tensor, meta: AttnMetadata, q: torch.Tensor, k: torch.Tensor,
                         v: torch.Tensor, rot: Rotation, keep_k: bool,
                         kv_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(rot(q), rot(k) if keep_k else None), with rot(k) and v written at their slots: the
    same values as `rot` then `write_kv`. Shapes are checked by the caller."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device) if keep_k else None
    _launch(cache, meta, k, v, q, q_out, k_out, rot, kv_scale)
    return q_out, k_out
