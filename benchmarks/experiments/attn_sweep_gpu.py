"""Which launch of the paged decode kernel reads K/V fastest, bf16 and FP8 caches (issues 41/42).

Decode rows of `ouro-1.4b-shape` (16 heads x 128, G = 1), each one request at position ctx-1 over
randomly placed blocks; times the paged kernel alone (no K/V write, no merge unless split) from
CUDA graphs for BLOCK_N x warps x stages x splits x dot dtype, and prints each against the K/V
bytes at the copy rate measured in the same run. FP8 dots in bf16 (today's) or fp16 (e4m3
converts exactly to both; fp16's conversion is one instruction per two values on sm_89+).

    PYTHONPATH=. python benchmarks/experiments/attn_sweep_gpu.py [--batches 32,64] [--ctx 1024]
"""

from __future__ import annotations

import argparse
import itertools
import math
import sys

import torch
import triton
import triton.language as tl

from benchmarks.attention_gpu import copy_bandwidth, decode_case, graph_ms
from loopserve.model.attention.triton_paged_attn import _merge_splits_kernel, _paged_attn_kernel, kv_tile
from loopserve.model.paged_kv import FP8


@triton.jit
def _fma_decode_kernel(Q, Cache, Out, BlockTables, Positions, qk_scale, sc_blk, sc_kv, sc_off, sc_h, sc_d, s_bt,
                       HQ: tl.constexpr, HEAD_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
    """One decode row x one head (G = 1) without tl.dot: q . k as FMAs and a row reduction (the
    fused loop's attention phase), so no shared-memory transpose and no 16-row padding."""
    row = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, HEAD_D)
    d_mask = d < HEAD_D
    q = tl.load(Q + (row * HQ + h) * HEAD_D + d).to(tl.float32) * qk_scale
    kv_hi = tl.load(Positions + row) + 1
    m_i = tl.full([1], float("-inf"), tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([HEAD_D], tl.float32)
    for n0 in range(0, kv_hi, BLOCK_N):
        kpos = n0 + tl.arange(0, BLOCK_N)
        k, v, in_range = kv_tile(Cache + h * sc_h, BlockTables + row * s_bt, kpos, kv_hi, d, d_mask, sc_blk,
                                 sc_kv, sc_off, sc_d, PAGE)
        s = tl.sum(q[None, :] * k.to(tl.float32), axis=1)
        s = tl.where(in_range, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=0))
        p = tl.exp2(s - m_new)
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p[:, None] * v.to(tl.float32), axis=0)
        m_i = m_new
    tl.store(Out + (row * HQ + h) * HEAD_D + d, (acc / l_i).to(Out.dtype.element_ty))


def launch_fma(q, cache, meta, block_n, warps, stages):
    rows, hq, d = q.shape
    out = torch.empty_like(q)

    def fn():
        _fma_decode_kernel[(rows, hq)](q, cache, out, meta.block_tables, meta.positions,
                                       d ** -0.5 * math.log2(math.e), *cache.stride(), meta.block_tables.stride(0),
                                       HQ=hq, HEAD_D=d, PAGE=meta.block_size, BLOCK_N=block_n,
                                       num_warps=warps, num_stages=stages)
    return fn, out


def launch(q, cache, meta, kv_scale, block_n, warps, stages, splits, dot):
    rows, hq, d = q.shape
    hkv = cache.shape[3]
    out = torch.empty_like(q)
    acc = torch.empty(splits, rows, hq, d, dtype=torch.float32, device=q.device)
    m = torch.empty(splits, rows, hq, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)

    def fn():
        _paged_attn_kernel[(rows + len(meta.seg_bounds), hkv, splits)](
            q, cache, kv_scale if kv_scale is not None else q, acc if splits > 1 else out, m, l,
            meta.seg_starts, meta.block_tables, meta.positions, len(meta.seg_bounds), rows, splits,
            d ** -0.5 * math.log2(math.e), 0, *q.stride(), *out.stride(), *cache.stride(),
            meta.block_tables.stride(0), G=hq // hkv, HQ=hq, HEAD_D=d, PAGE=meta.block_size, BQ=1,
            BLOCK_M=16, BLOCK_N=block_n, BLOCK_D=d, HAS_WINDOW=False, SPLIT=splits > 1, DOT_DTYPE=dot,
            KV_FP8=kv_scale is not None, num_warps=warps, num_stages=stages)
        if splits > 1:
            _merge_splits_kernel[(rows, hq)](acc, m, l, out, rows, splits, *out.stride(), HQ=hq, HEAD_D=d,
                                             BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=d)
    return fn, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--block-ns", default="32,64,128")
    ap.add_argument("--warps", default="4,8")
    ap.add_argument("--stages", default="2,3")
    ap.add_argument("--splits", default="1,2")
    args = ap.parse_args()
    print("command:", " ".join([sys.executable, *sys.argv]))
    print(f"device: {torch.cuda.get_device_name()}  triton {triton.__version__}")
    bw = copy_bandwidth()
    gen = torch.Generator().manual_seed(0)
    ints = lambda s: [int(x) for x in s.split(",")]
    for batch in ints(args.batches):
        meta, cache, q, k, v = decode_case(batch, args.ctx, 16, 16, 128, 16, torch.bfloat16, gen)
        cache = cache.contiguous()
        cache8, scale = cache.to(FP8), torch.ones(2, dtype=torch.float32, device="cuda")
        ref = None
        for kv, dot in (("bf16", tl.bfloat16), ("fp8", tl.float16), ("fp8", tl.bfloat16)):
            c, s = (cache, None) if kv == "bf16" else (cache8, scale)
            floor = 2 * batch * args.ctx * 16 * 128 * c.element_size() / bw * 1e6
            best, fma = [], []
            for bn, w, st, sp in itertools.product(ints(args.block_ns), ints(args.warps), ints(args.stages),
                                                   ints(args.splits)):
                qq = q.to(torch.float16) if dot == tl.float16 else q
                fn, out = launch(qq, c, meta, s, bn, w, st, sp, dot)
                try:
                    t = graph_ms(fn) * 1e3
                except Exception as e:  # out of shared memory at some stage counts
                    print(f"  {kv} dot {dot} n{bn} w{w} s{st} sp{sp}: {type(e).__name__}")
                    continue
                if ref is None:
                    ref = out.float().clone()
                err = (out.float() - ref).abs().max().item()
                best.append((t, bn, w, st, sp, err))
            best.sort()
            print(f"batch {batch} ctx {args.ctx} {kv} cache, dots in {dot}: floor {floor:.1f} us")
            for t, bn, w, st, sp, err in best[:6] + best[-1:]:
                print(f"  {t:7.1f} us  {floor / t:4.2f} of floor  BLOCK_N {bn:3d} warps {w} stages {st} "
                      f"splits {sp}  max|d| vs first {err:.3g}")
            for bn, w, st in itertools.product((32, 64, 128), (2, 4, 8), (2, 3)) if dot != tl.bfloat16 or kv == "bf16" else ():
                fn, out = launch_fma(q, c, meta, bn, w, st)
                try:
                    t = graph_ms(fn) * 1e3
                except Exception as e:  # noqa: BLE001
                    print(f"  fma n{bn} w{w} s{st}: {type(e).__name__}")
                    continue
                fma.append((t, bn, w, st, (out.float() - ref).abs().max().item()))
            fma.sort()
            for t, bn, w, st, err in fma[:3]:
                print(f"  fma kernel (no tl.dot): {t:7.1f} us  {floor / t:4.2f} of floor  BLOCK_N {bn} warps {w} "
                      f"stages {st}  max|d| {err:.3g}")
            today = [b for b in best if b[1:5] == (64, 4, 2, 1)]
            if today:
                print(f"  today's launch (BLOCK_N 64, 4 warps, 2 stages, 1 split): {today[0][0]:.1f} us, "
                      f"{floor / today[0][0]:.2f} of floor")
        del meta, cache, cache8, q, k, v
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
