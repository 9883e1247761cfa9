"""NIXL READ of KV blocks between two processes (CPU, UCX over loopback) vs a torch copy of the
same bytes inside one process, measured in the same run.

For each block count, two layouts: `contig` (consecutive ids on both sides: NIXL merges them
into one descriptor) and `scatter` (random ids: one descriptor per block). The READ time is
from start_read to poll() reporting it done; the copy is `dst[local] = src[remote]`.

    python benchmarks/kv_transfer_cpu.py [--max-blocks 4096] [--block-kib 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import random
import sys
import time

import torch

from loopserve.kv_transfer.nixl_agent import NixlKVWorker

LAYERS, TOKENS, HEADS = 4, 16, 4  # block = [layers, 2, tokens, heads, head_dim] bf16


def pool_shape(num_blocks: int, block_kib: int) -> tuple[int, ...]:
    head_dim = block_kib * 1024 // (LAYERS * 2 * TOKENS * HEADS * 2)
    return (num_blocks, LAYERS, 2, TOKENS, HEADS, head_dim)


def owner(conn, shape: tuple[int, ...]) -> None:
    pool = torch.randn(shape).to(torch.bfloat16)
    w = NixlKVWorker("bench-prefill", {"looped": pool}, TOKENS)
    conn.send(w.handshake_info())
    conn.recv()
    w.close()


def best_of(reps: int, fn) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-blocks", type=int, default=4096)
    ap.add_argument("--block-kib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    print("command:", " ".join([sys.executable, *sys.argv]), flush=True)
    shape = pool_shape(args.max_blocks, args.block_kib)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=owner, args=(child, shape), daemon=True)
    proc.start()
    info = conn.recv()
    local = torch.zeros(shape, dtype=torch.bfloat16)
    src, dst = torch.randn(shape).to(torch.bfloat16), torch.empty(shape, dtype=torch.bfloat16)
    w = NixlKVWorker("bench-decode", {"looped": local}, TOKENS, capture_telemetry=True)
    w.add_peer(info)
    block_bytes = local[0].nbytes
    print(f"block {block_bytes / 1024:.0f} KiB, pool {local.nbytes / 2**20:.0f} MiB per side, best of {args.reps}")
    print(f"{'blocks':>7} {'layout':>8} {'MiB':>8} {'descs':>6} {'NIXL GB/s':>10} {'copy GB/s':>10} {'NIXL/copy':>10}")
    rng, seq = random.Random(0), 0
    n = 1
    while n <= args.max_blocks:
        for layout in ("contig", "scatter"):
            remote = list(range(n)) if layout == "contig" else rng.sample(range(args.max_blocks), n)
            loc = list(range(n)) if layout == "contig" else rng.sample(range(args.max_blocks), n)
            table_r, table_l = {"flat": [], "depth": [remote]}, {"flat": [], "depth": [loc]}

            def read() -> None:
                nonlocal seq
                seq += 1
                w.start_read(f"r{seq}", "bench-prefill", table_r, table_l, n * TOKENS)
                done, failed, end = [], [], time.monotonic() + 60
                while not (done or failed) and time.monotonic() < end:
                    done, failed = w.poll()
                    time.sleep(0)  # let NIXL's progress thread run
                assert done == [f"r{seq}"], failed

            t_nixl = best_of(args.reps, read)
            descs = w.read_stats[f"r{seq}"].descriptors
            w.read_stats.clear()
            ids = torch.tensor(remote)
            t_copy = best_of(args.reps, lambda: torch.index_select(src, 0, ids, out=dst[:n]))
            nbytes = n * block_bytes
            g_nixl, g_copy = nbytes / t_nixl / 1e9, nbytes / t_copy / 1e9
            print(f"{n:>7} {layout:>8} {nbytes / 2**20:>8.2f} {descs:>6} {g_nixl:>10.2f} {g_copy:>10.2f} "
                  f"{g_nixl / g_copy:>10.2f}", flush=True)
        n *= 4
    conn.send("stop")
    proc.join(timeout=30)
    w.close()


if __name__ == "__main__":
    main()
