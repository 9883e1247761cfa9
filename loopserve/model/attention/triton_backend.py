"""Triton paged, depth-aware attention backend (CUDA; CPU tensors under TRITON_INTERPRET=1).

Depth-awareness needs nothing special here: each segment brings its own plane's block table.
Launch parameters come from host-side metadata only (`seg_bounds`, `max_context_len`), so a
forward never waits on the device.

A prompt's first chunk (rows = positions 0..n-1, none exited) reads nothing but its own new
K/V, so those segments go to torch's SDPA (FlashAttention / cuDNN on Hopper) on the rows
directly; the paged kernel takes the rest of the batch. An FP8 cache (a `kv_scale` given) is
quantized by the write kernel and dequantized inside the paged kernel; SDPA's fresh rows see
the same rounded K/V. FP8 decode batches with one query head per KV head (every segment one
row, G = 1) go to `_decode_fma_kernel` (no tl.dot; same split-KV partials and merge).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from loopserve.intmath import cdiv
from loopserve.model.attention.triton_kv_write import triton_rope_write_kv, triton_write_kv
from loopserve.model.attention.triton_paged_attn import (_decode_fma_kernel, _merge_splits_kernel,
                                                         _paged_attn_kernel)
from loopserve.model.attention.base import stored
from loopserve.model.attention.segments import fresh_segments, subset
from loopserve.model.batch import AttnMetadata
from loopserve.model.layers import Rotation
from loopserve.model.paged_kv import FP8

_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_CACHE_DTYPES = (*_DTYPES, FP8)  # tl.float8e4nv: e4m3fn (Hopper's and Ada's FP8 conversions)
_MAX_BLOCK_SIZE = 128
_MAX_HEAD_DIM = 256
_MAX_SPLITS = 64
_MIN_SPLIT_LEN = 128  # KV positions per split worth a program of its own
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DENSE_PREFILL_ROWS = 64  # shorter fresh segments stay in the paged kernel (one launch for all)
_FMA_BLOCK_N, _FMA_WARPS, _FMA_STAGES = 128, 4, 3  # _decode_fma_kernel's launch (docs/benchmarks.md)


@dataclass(frozen=True)
class LaunchConfig:
    rows_per_tile: int  # BQ: query rows of one segment per program
    block_m: int  # score rows: rows_per_tile * group, padded to a power of two (>= 16 for tl.dot)
    block_n: int  # KV positions per inner step
    num_splits: int  # KV chunks per tile (flash-decoding); 1 = write the output directly
    num_warps: int


@lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _pow2_floor(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def launch_config(meta: AttnMetadata, group: int, num_kv_heads: int, num_sms: int,
                  kv_splits: int | None = None, fp32: bool = False) -> LaunchConfig:
    """Decode (one row per segment) packs one row's group heads per program and splits long KV
    ranges until the GPU is covered about twice; prefill tiles 128 score rows per program (64
    in fp32, whose tiles take twice the registers)."""
    max_rows = max((b - a for a, b in meta.seg_bounds), default=1)
    score_rows = 64 if fp32 else 128
    rows = min(triton.next_power_of_2(max(max_rows, 1)), _pow2_floor(score_rows // group))
    block_m = max(16, triton.next_power_of_2(rows * group))
    tiles = sum(cdiv(b - a, rows) for a, b in meta.seg_bounds)
    if kv_splits is None:
        want = 2 * num_sms // max(tiles * num_kv_heads, 1)
        kv_splits = min(_pow2_floor(want), _pow2_floor(meta.max_context_len // _MIN_SPLIT_LEN), _MAX_SPLITS)
    return LaunchConfig(rows_per_tile=rows, block_m=block_m, block_n=64, num_splits=max(kv_splits, 1),
                        num_warps=8 if block_m >= 128 else 4)


class TritonAttention:
    """`AttentionBackend` on Triton kernels. `kv_splits` forces the split-KV count (tests,
    benchmarks); None picks it from the batch shape and the GPU's SM count. Fresh prompt
    segments of at least `dense_prefill_rows` rows go to SDPA (None: never)."""

    def __init__(self, kv_splits: int | None = None,
                 dense_prefill_rows: int | None = DENSE_PREFILL_ROWS) -> None:
        if kv_splits is not None and not 1 <= kv_splits <= _MAX_SPLITS:
            raise ValueError(f"kv_splits={kv_splits} must be in [1, {_MAX_SPLITS}]")
        self.kv_splits = kv_splits
        self.dense_prefill_rows = dense_prefill_rows

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                meta: AttnMetadata, scale: float, window: int | None = None,
                rot: Rotation | None = None, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
        _check_inputs(q, k, v, cache, meta, window, rot, kv_scale)
        fresh = [] if window is not None or self.dense_prefill_rows is None else \
            fresh_segments(meta, self.dense_prefill_rows)
        if rot is None:
            triton_write_kv(cache, meta, k, v, kv_scale)
        else:  # RoPE fused into the slot write; SDPA's fresh rows need the rotated k too
            q, k_rot = triton_rope_write_kv(cache, meta, q, k, v, rot, keep_k=bool(fresh), kv_scale=kv_scale)
            k = k if k_rot is None else k_rot
        out = torch.empty_like(q)
        if q.shape[0] == 0:
            return out
        if not fresh:
            return self._attend(q, cache, meta, scale, window, out, kv_scale)
        # what the plane holds
        k = stored(k, cache.dtype, None if kv_scale is None else kv_scale[0]).to(q.dtype)
        v = stored(v, cache.dtype, None if kv_scale is None else kv_scale[1]).to(q.dtype)
        for s in fresh:
            a, b = meta.seg_bounds[s]
            o = F.scaled_dot_product_attention(q[a:b].transpose(0, 1)[None], k[a:b].transpose(0, 1)[None],
                                               v[a:b].transpose(0, 1)[None], is_causal=True, scale=scale,
                                               enable_gqa=True)
            out[a:b] = o[0].transpose(0, 1)
        dense = set(fresh)
        rest = [s for s in range(len(meta.seg_bounds)) if s not in dense]
        if rest:
            rows, sub = subset(meta, rest)
            if rows.numel():
                out[rows] = self._attend(q[rows], cache, sub, scale, window, torch.empty_like(q[rows]),
                                         kv_scale)
        return out

    def _attend(self, q: torch.Tensor, cache: torch.Tensor, meta: AttnMetadata, scale: float,
                window: int | None, out: torch.Tensor, kv_scale: torch.Tensor | None) -> torch.Tensor:
        num_rows, hq, head_d = q.shape
        hkv = cache.shape[3]
        group = hq // hkv
        num_sms = 1 if _INTERPRET else _num_sms(q.device)
        if cache.dtype == FP8:  # e4m3 values convert exactly to q's dtype
            dot_dtype = _DTYPES[q.dtype]
        else:
            dot_dtype = _DTYPES[cache.dtype] if q.dtype == cache.dtype else tl.float32
        if _INTERPRET and dot_dtype == tl.bfloat16:
            dot_dtype = tl.float32  # the interpreter's numpy dot misreads bf16 operands
        cfg = launch_config(meta, group, hkv, num_sms, self.kv_splits, fp32=dot_dtype == tl.float32)
        block_d = max(16, triton.next_power_of_2(head_d))  # tl.dot needs K >= 16
        num_segs = len(meta.seg_bounds)
        split = cfg.num_splits > 1
        if split:
            acc = torch.empty(cfg.num_splits, num_rows, hq, head_d, dtype=torch.float32, device=q.device)
            m_part = torch.empty(cfg.num_splits, num_rows, hq, dtype=torch.float32, device=q.device)
            l_part = torch.empty_like(m_part)
        else:
            acc, m_part, l_part = out, out, out  # the partial buffers are unused without SPLIT
        qk_scale = scale * math.log2(math.e)
        if cache.dtype == FP8 and group == 1 and all(b - a == 1 for a, b in meta.seg_bounds):
            _decode_fma_kernel[(num_segs, hq, cfg.num_splits)](
                q, cache, kv_scale, acc, m_part, l_part, meta.seg_starts, meta.block_tables, meta.positions,
                num_rows, cfg.num_splits, qk_scale, window or 0,
                *q.stride(), *out.stride(), *cache.stride(), meta.block_tables.stride(0),
                HQ=hq, HEAD_D=head_d, PAGE=meta.block_size, BLOCK_N=_FMA_BLOCK_N,
                BLOCK_D=triton.next_power_of_2(head_d), HAS_WINDOW=window is not None, SPLIT=split,
                KV_FP8=True, num_warps=_FMA_WARPS, num_stages=_FMA_STAGES)
        else:
            grid = (num_rows // cfg.rows_per_tile + num_segs, hkv, cfg.num_splits)
            _paged_attn_kernel[grid](
                q, cache, kv_scale if kv_scale is not None else q, acc, m_part, l_part, meta.seg_starts,
                meta.block_tables, meta.positions,
                num_segs, num_rows, cfg.num_splits, qk_scale, window or 0,
                *q.stride(), *out.stride(), *cache.stride(), meta.block_tables.stride(0),
                G=group, HQ=hq, HEAD_D=head_d, PAGE=meta.block_size, BQ=cfg.rows_per_tile,
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
                HAS_WINDOW=window is not None, SPLIT=split, DOT_DTYPE=dot_dtype, KV_FP8=kv_scale is not None,
                num_warps=cfg.num_warps, num_stages=2)
        if split:
            _merge_splits_kernel[(num_rows, hq)](
                acc, m_part, l_part, out, num_rows, cfg.num_splits, *out.stride(),
                HQ=hq, HEAD_D=head_d, BLOCK_S=triton.next_power_of_2(cfg.num_splits), BLOCK_D=block_d)
        return out


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: torch.Tensor,
                  meta: AttnMetadata, window: int | None, rot: Rotation | None,
                  kv_scale: torch.Tensor | None) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    num_rows, hq, head_d = q.shape
    if cache.dim() != 5 or cache.shape[1] != 2:
        raise ValueError(f"cache must be [num_blocks, 2, block_size, Hkv, D], got shape {tuple(cache.shape)}")
    hkv = cache.shape[3]
    for name, t in (("k", k), ("v", v)):
        if tuple(t.shape) != (num_rows, hkv, head_d):
            raise ValueError(f"{name} shape {tuple(t.shape)} != (T, Hkv, D) = {(num_rows, hkv, head_d)}")
    if tuple(cache.shape[2:]) != (meta.block_size, hkv, head_d):
        raise ValueError(f"cache shape {tuple(cache.shape)} does not match block_size={meta.block_size}, "
                         f"Hkv={hkv}, D={head_d}")
    if hq % hkv:
        raise ValueError(f"Hq={hq} is not a multiple of Hkv={hkv}")
    bs = meta.block_size
    if bs < 1 or bs > _MAX_BLOCK_SIZE or bs & (bs - 1):
        raise ValueError(f"block_size={bs} must be a power of two in [1, {_MAX_BLOCK_SIZE}]")
    if not 1 <= head_d <= _MAX_HEAD_DIM:
        raise ValueError(f"head_dim={head_d} must be in [1, {_MAX_HEAD_DIM}]")
    for name, t in (("q", q), ("k", k), ("v", v), ("cache", cache)):
        allowed = _CACHE_DTYPES if name == "cache" else _DTYPES
        if t.dtype not in allowed:
            raise ValueError(f"{name} dtype {t.dtype} not supported (one of {list(allowed)})")
        if t.device != cache.device or (t.device.type != "cuda" and not _INTERPRET):
            raise ValueError(f"{name} is on {t.device}: TritonAttention needs CUDA tensors on one device "
                             f"(CPU only under TRITON_INTERPRET=1)")
    if (cache.dtype == FP8) != (kv_scale is not None):
        raise ValueError(f"kv_scale must be given exactly for an FP8 cache (cache is {cache.dtype}, "
                         f"kv_scale {'given' if kv_scale is not None else 'None'})")
    if kv_scale is not None and (tuple(kv_scale.shape) != (2,) or kv_scale.dtype != torch.float32
                                 or kv_scale.device != cache.device or not kv_scale.is_contiguous()):
        raise ValueError(f"kv_scale must be a contiguous fp32 [2] (k_scale, v_scale) on {cache.device}, got "
                         f"{kv_scale.dtype} {tuple(kv_scale.shape)} on {kv_scale.device}")
    if meta.positions.shape[0] != num_rows or meta.slot_mapping.shape[0] != num_rows:
        raise ValueError(f"meta.positions/slot_mapping have {meta.positions.shape[0]}/"
                         f"{meta.slot_mapping.shape[0]} rows, q has T={num_rows}")
    if meta.block_tables.dtype != torch.int32:
        raise ValueError(f"meta.block_tables dtype {meta.block_tables.dtype} must be torch.int32")
    if window is not None and window < 1:
        raise ValueError(f"window={window} must be >= 1 (or None)")
    if rot is not None:
        want = (num_rows, 1, head_d // 2)
        for name, t in (("rot.cos", rot.cos), ("rot.sin", rot.sin)):
            if head_d % 2 or tuple(t.shape) != want or t.dtype != torch.float32 or t.stride(-1) != 1 \
                    or t.stride(0) != rot.cos.stride(0) or t.device != cache.device:
                raise ValueError(f"{name} must be fp32 {want} on {cache.device} with unit stride in its last "
                                 f"dim (even head_dim), got {tuple(t.shape)} {t.dtype} on {t.device}")
