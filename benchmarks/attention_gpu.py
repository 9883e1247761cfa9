"""Decode attention on CUDA: Triton paged backend vs the torch reference vs an SDPA lower bound.

Every row is one decode token of its own request (position ctx-1), reading a paged cache of
randomly placed blocks. The SDPA figure runs the same attention over K/V laid out dense and
contiguous (each KV head's group of query heads as g queries, non-causal: the same sums), so
it has no paging cost: a lower bound, not a competitor. The HBM floor is the
K/V bytes over a device copy's bandwidth measured in the same run. Times are medians of CUDA
graph replays (kernel time) and, for the reference, of eager calls (it is a Python loop).

    python benchmarks/attention_gpu.py [--batches 1,8,64,256] [--contexts 1024,4096] [--kv-splits 1,2,4,8]

`--kv-splits` adds, per case, the Triton forward with each forced split-KV count (the launch
heuristic's choice is the `triton` column).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import triton

from loopserve.intmath import cdiv
from loopserve.model.attention.base import write_kv
from loopserve.model.attention.torch_ref import TorchAttention
from loopserve.model.attention.triton_backend import TritonAttention
from loopserve.model.attention.triton_kv_write import triton_write_kv
from tests.attn_metadata import build_attn_metadata


def graph_ms(fn) -> float:
    """Median ms of one call, replayed from a CUDA graph of 10 calls (no launch overhead)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()  # compile/warm on the capture stream
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(10):
            fn()
    return triton.testing.do_bench(g.replay, warmup=10, rep=60, return_mode="median") / 10


def eager_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=60, return_mode="median")


def copy_bandwidth() -> float:
    """Bytes/s of a device-to-device copy, counting the read and the write."""
    src = torch.empty(2 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3)


def decode_case(batch: int, ctx: int, hq: int, hkv: int, head_dim: int, block_size: int,
                dtype: torch.dtype, gen: torch.Generator):
    nblk = cdiv(ctx, block_size)
    perm = torch.randperm(batch * nblk, generator=gen).tolist()
    tables = [perm[i * nblk:(i + 1) * nblk] for i in range(batch)]
    meta = build_attn_metadata(list(range(batch)), [ctx - 1] * batch, tables, block_size,
                               torch.device("cuda"))
    pool = torch.randn(batch * nblk, 2, 2, block_size, hkv, head_dim, dtype=dtype, device="cuda")
    q = torch.randn(batch, hq, head_dim, dtype=dtype, device="cuda")
    k, v = (torch.randn(batch, hkv, head_dim, dtype=dtype, device="cuda") for _ in range(2))
    return meta, pool[:, 1], q, k, v  # layer 1 of a two-layer block-major pool: a strided view


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--contexts", default="1024,4096")
    ap.add_argument("--hq", type=int, default=32)
    ap.add_argument("--hkv", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-splits", default="", help="forced split counts to time as well")
    ap.add_argument("--skip-ref-above", type=int, default=1 << 20,
                    help="skip the torch reference when batch*ctx exceeds this")
    args = ap.parse_args()
    print("command:", " ".join([sys.executable, *sys.argv]))
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    dtype, gen = torch.bfloat16, torch.Generator().manual_seed(0)
    bw = copy_bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; Hq={args.hq} Hkv={args.hkv} D={args.head_dim} "
          f"block_size={args.block_size} bf16; times in us")
    print(f"{'batch':>5} {'ctx':>5} {'triton':>8} {'t.attn':>8} {'ref':>9} {'sdpa':>8} {'floor':>7} "
          f"{'x sdpa':>6} {'x ref':>6}")
    scale = args.head_dim ** -0.5
    tri = TritonAttention()
    for ctx in map(int, args.contexts.split(",")):
        for batch in map(int, args.batches.split(",")):
            meta, cache, q, k, v = decode_case(batch, ctx, args.hq, args.hkv, args.head_dim,
                                               args.block_size, dtype, gen)
            t_tri = graph_ms(lambda: tri.forward(q, k, v, cache, meta, scale)) * 1e3
            t_attn = graph_ms(lambda: tri._attend(q, cache, meta, scale, None, torch.empty_like(q))) * 1e3
            t_ref = (eager_ms(lambda: TorchAttention().forward(q, k, v, cache, meta, scale)) * 1e3
                     if batch * ctx <= args.skip_ref_above else float("nan"))
            kd = torch.randn(batch, args.hkv, ctx, args.head_dim, dtype=dtype, device="cuda")
            vd = torch.randn_like(kd)
            qd = q.view(batch, args.hkv, args.hq // args.hkv, args.head_dim)
            t_sdpa = graph_ms(lambda: F.scaled_dot_product_attention(qd, kd, vd, scale=scale)) * 1e3
            floor = 2 * kd.numel() * kd.element_size() / bw * 1e6
            print(f"{batch:>5} {ctx:>5} {t_tri:>8.1f} {t_attn:>8.1f} {t_ref:>9.1f} {t_sdpa:>8.1f} "
                  f"{floor:>7.1f} {t_tri / t_sdpa:>6.2f} {t_ref / t_tri:>6.1f}")
            if args.kv_splits:
                forced = {n: graph_ms(lambda: TritonAttention(kv_splits=n).forward(q, k, v, cache, meta, scale)) * 1e3
                          for n in map(int, args.kv_splits.split(","))}
                print("      forced splits: " + "  ".join(f"{n}: {t:.1f}" for n, t in forced.items()))
            del meta, cache, q, k, v, kd, vd
            torch.cuda.empty_cache()
    print("slot write (k, v of T rows), us:  T  triton (graph)  torch-index_put (eager: its slot -1 check syncs)")
    for rows in (1, 64, 256, 4096):
        meta, cache, q, k, v = decode_case(rows, 16, args.hq, args.hkv, args.head_dim,
                                           args.block_size, dtype, gen)
        t_w = graph_ms(lambda: triton_write_kv(cache, meta, k, v)) * 1e3
        t_t = eager_ms(lambda: write_kv(cache, meta, k, v)) * 1e3
        print(f"{rows:>5} {t_w:>8.1f} {t_t:>8.1f}")


if __name__ == "__main__":
    main()
