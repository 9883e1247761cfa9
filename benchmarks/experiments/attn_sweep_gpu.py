"""Which launch of the paged decode kernel reads K/V fastest, bf16 and FP8 caches (issues 41/42).

Decode rows of `ouro-1.4b-shape` (16 heads x 128, G = 1), each one request at position ctx-1 over
randomly placed blocks; times the paged kernel alone (no K/V write, no merge unless split) from
CUDA graphs for BLOCK_N x warps x stages x splits x dot dtype, and prints each against the K/V
bytes at the copy rate measured in the same run. FP8 dots in bf16 (today's) or fp16 (e4m3
converts exactly to both; fp16's conversion is one instruction per two values on sm_89+). The FMA
column is `_decode_fma_kernel` (no tl.dot; TritonAttention's kernel for FP8 decode rows with
G = 1), once per cache dtype, printed under the bf16-dot rows.

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
from loopserve.model.attention.triton_paged_attn import (_decode_fma_kernel, _merge_splits_kernel,
                                                         _paged_attn_kernel)
from loopserve.model.paged_kv import FP8


def launch_fma(q, cache, meta, kv_scale, block_n, warps, stages):
    """The product `_decode_fma_kernel` (one split), as TritonAttention launches it for FP8 decode rows
    with G = 1 (BLOCK_N 128, 4 warps, 3 stages); a bf16 cache runs it too (KV_FP8 off)."""
    rows, hq, d = q.shape
    out = torch.empty_like(q)

    def fn():
        _decode_fma_kernel[(len(meta.seg_bounds), hq, 1)](
            q, cache, kv_scale if kv_scale is not None else q, out, out, out, meta.seg_starts,
            meta.block_tables, meta.positions, rows, 1, d ** -0.5 * math.log2(math.e), 0,
            *q.stride(), *out.stride(), *cache.stride(), meta.block_tables.stride(0),
            HQ=hq, HEAD_D=d, PAGE=meta.block_size, BLOCK_N=block_n, BLOCK_D=triton.next_power_of_2(d),
            HAS_WINDOW=False, SPLIT=False, KV_FP8=kv_scale is not None, num_warps=warps, num_stages=stages)
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
            for bn, w, st in itertools.product((32, 64, 128), (2, 4, 8), (2, 3)) if dot == tl.bfloat16 else ():
                fn, out = launch_fma(q, c, meta, s, bn, w, st)
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
