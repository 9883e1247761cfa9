"""Paged-attention cases shared by the Triton tests on GPU and under the interpreter.

A case is a batch of segments (rows with ascending, possibly gappy positions) over a random
block-major pool of several layers; each segment owns random distinct blocks, so segments of
one request at different depths are simply segments with different block tables. Positions
not written by the batch hold earlier tokens' random K/V.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from loopserve.intmath import cdiv
from loopserve.model.attention.torch_ref import TorchAttention
from loopserve.model.batch import AttnMetadata
from tests.attn_metadata import build_attn_metadata
from loopserve.model.layers import Rope, Rotation
from loopserve.model.paged_kv import FP8, FP8_MAX, dequantize, quantize

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
# An FP8 pool: written values may differ from torch's by one e4m3 step (a GPU's rounding of the
# rotated k, the interpreter flushing subnormals to zero), the outputs by what that moves.
FP8_OUT_TOLERANCE = {torch.float32: 1e-2, torch.float16: 3e-2, torch.bfloat16: 4e-2}
FP8_SCALES = (0.5, 2.0)  # distinct k and v scales: a kernel that swaps or drops one fails


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    pool: torch.Tensor  # [num_blocks, layers, 2, block_size, Hkv, D]; tests attend on pool[:, layer]
    layer: int
    meta: AttnMetadata
    scale: float
    rot: Rotation | None = None  # q and k arrive unrotated; both backends apply it
    kv_scale: torch.Tensor | None = None  # [2] (k_scale, v_scale) of an FP8 pool


def make_case(seg_positions: list[list[int]], hq: int, hkv: int, head_dim: int, block_size: int,
              dtype: torch.dtype, device: str, seed: int = 0, layers: int = 2,
              strided_q: bool = False, rope: str | None = None, skip_blocks: int = 0,
              kv_scales: tuple[float, float] | None = None) -> Case:
    """`strided_q` slices q, k and v out of one fused projection, as a model's qkv split does;
    `rope` ("half" or "interleaved") hands both backends the rows' RoPE rotation;
    `skip_blocks` zero blocks below the segments' (a pool past 2^31 elements, cheaply);
    `kv_scales` (k_scale, v_scale): an FP8 pool holding the random K/V quantized by them (a few
    values past the range: the writes must clamp)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    need = [cdiv(max(ps) + 1, block_size) if ps else 0 for ps in seg_positions]
    num_blocks = sum(need) + 3  # a few blocks no segment owns: they must stay untouched
    free = [skip_blocks + b for b in rng.sample(range(num_blocks), num_blocks)]
    tables = [[free.pop() for _ in range(n)] for n in need]
    rows_seg = [s for s, ps in enumerate(seg_positions) for _ in ps]
    rows_pos = [p for ps in seg_positions for p in ps]
    meta = build_attn_metadata(rows_seg, rows_pos, tables, block_size, torch.device(device))
    t = len(rows_pos)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype=dtype, device=device)

    pool = randn(num_blocks, layers, 2, block_size, hkv, head_dim)
    kv_scale = None
    if kv_scales is not None:
        kv_scale = torch.tensor(kv_scales, dtype=torch.float32, device=device)
        pool = torch.stack([quantize(pool[:, :, i], kv_scale[i]) for i in (0, 1)], dim=2)
    if skip_blocks:
        pool = torch.cat([pool.new_zeros(skip_blocks, *pool.shape[1:]), pool])
    if strided_q:
        q, k, v = randn(t, hq + 2 * hkv, head_dim).split([hq, hkv, hkv], dim=1)
    else:
        q, k, v = randn(t, hq, head_dim), randn(t, hkv, head_dim), randn(t, hkv, head_dim)
    if kv_scale is not None:  # out of e4m3's range after the scale: clamped to ±448
        k[:1, :1, :2] = torch.tensor([1e3, -1e3], dtype=dtype)
        v[:1, :1, :2] = torch.tensor([-5e3, 5e3], dtype=dtype)
    rot = None if rope is None else Rope(head_dim, 10000.0, rope == "interleaved")(meta.positions)
    return Case(q, k, v, pool, layers - 1, meta, head_dim ** -0.5, rot, kv_scale)


class LaunchCount:
    """Stands in for a Triton kernel a module launches by name (monkeypatch it in) and counts
    the launches: which kernel served a batch."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        self.launches += 1
        return self.kernel[grid]


def count_attention_launches(monkeypatch) -> dict[str, LaunchCount]:
    """{"fma": ..., "dot": ...}: the backend's `_decode_fma_kernel` and `_paged_attn_kernel`."""
    from loopserve.model.attention import triton_backend

    spies = {"fma": LaunchCount(triton_backend._decode_fma_kernel),
             "dot": LaunchCount(triton_backend._paged_attn_kernel)}
    monkeypatch.setattr(triton_backend, "_decode_fma_kernel", spies["fma"])
    monkeypatch.setattr(triton_backend, "_paged_attn_kernel", spies["dot"])
    return spies


def random_segments(seed: int, num_segs: int, max_pos: int, max_rows: int) -> list[list[int]]:
    """Mixed decode (one row) and prefill-like (many rows, gaps allowed) segments, one empty."""
    rng = random.Random(seed)
    segs = []
    for s in range(num_segs):
        ctx = rng.randint(1, max_pos)
        rows = 1 if s % 2 else rng.randint(1, min(max_rows, ctx))
        segs.append(sorted(rng.sample(range(ctx - 1), rows - 1)) + [ctx - 1])
    segs.insert(rng.randrange(len(segs) + 1), [])
    return segs


def run_both(case: Case, backend, window: int | None = None) -> tuple[torch.Tensor, torch.Tensor,
                                                                      torch.Tensor, torch.Tensor]:
    """(backend out, reference out, backend pool, reference pool) from identical inputs."""
    ref_pool, pool = case.pool.clone(), case.pool.clone()
    ref = TorchAttention().forward(case.q, case.k, case.v, ref_pool[:, case.layer], case.meta,
                                   case.scale, window, case.rot, case.kv_scale)
    out = backend.forward(case.q, case.k, case.v, pool[:, case.layer], case.meta, case.scale, window,
                          case.rot, case.kv_scale)
    return out, ref, pool, ref_pool


def dequantized(pool: torch.Tensor, kv_scale: torch.Tensor) -> torch.Tensor:
    return torch.stack([dequantize(pool[:, :, i], kv_scale[i], torch.float32) for i in (0, 1)], dim=2)


def assert_matches(case: Case, backend, window: int | None = None) -> None:
    out, ref, pool, ref_pool = run_both(case, backend, window)
    tol = TOLERANCE[case.q.dtype]
    if case.kv_scale is not None:
        assert pool.dtype == ref_pool.dtype == FP8
        got, want = dequantized(pool, case.kv_scale), dequantized(ref_pool, case.kv_scale)
        assert bool(torch.isfinite(got).all()), "an FP8 write overflowed (no clamp)"
        assert float(got.abs().max()) <= FP8_MAX * float(case.kv_scale.max())
        # one e4m3 step (2^-3 relative) apart, or both under the smallest normal (2^-6 x scale)
        torch.testing.assert_close(got, want, rtol=2 ** -3, atol=2 ** -6 * float(case.kv_scale.max()))
        assert (got != want).float().mean() < 0.01, "more than a few FP8 writes differ from the reference"
        torch.testing.assert_close(out.float(), ref.float(), atol=FP8_OUT_TOLERANCE[case.q.dtype],
                                   rtol=FP8_OUT_TOLERANCE[case.q.dtype])
        return
    if case.rot is None or (pool.device.type == "cpu" and pool.dtype == torch.float32):
        assert torch.equal(pool, ref_pool), "K/V slot write differs from the reference (or touched other slots)"
    else:  # the rotated k's rounding to 16 bits (a GPU's fused multiply-add, the interpreter's
        # casts) can differ from torch's by one ulp
        torch.testing.assert_close(pool, ref_pool, atol=tol, rtol=tol)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
