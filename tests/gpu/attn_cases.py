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

TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


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


def make_case(seg_positions: list[list[int]], hq: int, hkv: int, head_dim: int, block_size: int,
              dtype: torch.dtype, device: str, seed: int = 0, layers: int = 2,
              strided_q: bool = False, rope: str | None = None, skip_blocks: int = 0) -> Case:
    """`strided_q` slices q, k and v out of one fused projection, as a model's qkv split does;
    `rope` ("half" or "interleaved") hands both backends the rows' RoPE rotation;
    `skip_blocks` zero blocks below the segments' (a pool past 2^31 elements, cheaply)."""
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
    if skip_blocks:
        pool = torch.cat([pool.new_zeros(skip_blocks, *pool.shape[1:]), pool])
    if strided_q:
        q, k, v = randn(t, hq + 2 * hkv, head_dim).split([hq, hkv, hkv], dim=1)
    else:
        q, k, v = randn(t, hq, head_dim), randn(t, hkv, head_dim), randn(t, hkv, head_dim)
    rot = None if rope is None else Rope(head_dim, 10000.0, rope == "interleaved")(meta.positions)
    return Case(q, k, v, pool, layers - 1, meta, head_dim ** -0.5, rot)


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
                                   case.scale, window, case.rot)
    out = backend.forward(case.q, case.k, case.v, pool[:, case.layer], case.meta, case.scale, window,
                          case.rot)
    return out, ref, pool, ref_pool


def assert_matches(case: Case, backend, window: int | None = None) -> None:
    out, ref, pool, ref_pool = run_both(case, backend, window)
    tol = TOLERANCE[case.q.dtype]
    if case.rot is None or (pool.device.type == "cpu" and pool.dtype == torch.float32):
        assert torch.equal(pool, ref_pool), "K/V slot write differs from the reference (or touched other slots)"
    else:  # the rotated k's rounding to 16 bits (a GPU's fused multiply-add, the interpreter's
        # casts) can differ from torch's by one ulp
        torch.testing.assert_close(pool, ref_pool, atol=tol, rtol=tol)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
