"""Batch-1 GEMV on CUDA: a Triton kernel (best of 12 tile configs per shape) and F.linear on
cuBLASLt vs F.linear on cuBLAS (torch's default), all timed inside CUDA graphs (50 calls per
graph, launch gaps included). Calls cycle through 4 copies of the weight (more than the
50 MB L2), as a decode step reads every weight once.

The shapes are ouro-1.4b-shape's merged decode projections: q/k/v, o, gate/up, down. It
answers whether a hand-written GEMV would close the batch-1 decode gap (it does not).

Usage (from the repository root): PYTHONPATH=. python benchmarks/experiments/gemv_gpu.py
"""

from __future__ import annotations

import itertools
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks.fused_loop_gpu import graph_time

SHAPES = ((6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632))  # (N out, K in)
CONFIGS = [(bn, bk, w) for bn in (8, 16, 32) for bk in (256, 512) for w in (4, 8)]


@triton.jit
def _gemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rm = tl.arange(0, BM)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k0 in range(0, K, BK):
        rk = k0 + tl.arange(0, BK)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=(rn[:, None] < N) & (rk[None, :] < K), other=0.0)
        x = tl.load(x_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)
        acc += tl.sum(x[:, None, :].to(tl.float32) * w[None, :, :].to(tl.float32), axis=2)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemv(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, bn: int, bk: int, warps: int) -> None:
    m, k = x.shape
    n = w.shape[0]
    _gemv_kernel[(triton.cdiv(n, bn),)](x, w, y, m, n, k, BM=triton.next_power_of_2(m), BN=bn, BK=bk,
                                        num_warps=warps)


def main() -> None:
    for n, k in SHAPES:
        w = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") / k ** 0.5
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        ref = F.linear(x, w)
        ws = itertools.cycle([w] + [w.clone() for _ in range(3)])
        t_cublas = graph_time(lambda: F.linear(x, next(ws)))
        torch.backends.cuda.preferred_blas_library("cublaslt")
        if (F.linear(x, w).float() - ref.float()).abs().max().item() > 0.05:
            raise AssertionError(f"cuBLASLt disagrees with cuBLAS for {n}x{k}")
        t_lt = graph_time(lambda: F.linear(x, next(ws)))
        torch.backends.cuda.preferred_blas_library("cublas")
        y = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        best = (float("inf"), None)
        for cfg in CONFIGS:
            gemv(x, w, y, *cfg)
            if (y.float() - ref.float()).abs().max().item() > 0.05:
                raise AssertionError(f"Triton GEMV {cfg} disagrees with F.linear for {n}x{k}")
            best = min(best, (graph_time(lambda: gemv(x, next(ws), y, *cfg)), cfg))
        mb = n * k * 2 / 1e6
        print(f"[gemv] {n}x{k} ({mb:.0f} MB): cuBLAS {t_cublas * 1e6:.2f} us ({mb / t_cublas / 1e6:.2f} TB/s), "
              f"Triton {best[0] * 1e6:.2f} us ({mb / best[0] / 1e6:.2f} TB/s, BN/BK/warps {best[1]}) "
              f"-> Triton/cuBLAS time {best[0] / t_cublas:.2f}x; cuBLASLt {t_lt * 1e6:.2f} us "
              f"-> cuBLASLt/cuBLAS time {t_lt / t_cublas:.2f}x", flush=True)
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
