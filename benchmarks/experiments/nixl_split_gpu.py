"""NIXL transfers of KV blocks between two processes on one GPU: READ (the decode side pulls,
what the connector does) vs WRITE (the prefill side pushes), each as one transfer or split
into k concurrent ones, against torch's copy of the same bytes in the same run.

UCX moves both with one `cuMemcpyDtoDAsync` per descriptor on its own stream (cuda_ipc
get_zcopy / put_zcopy); UCX disables cuda_ipc GET where it sees no NVLink because
concurrent reads can be slower than concurrent puts there (openucx/ucx#7566), so WRITE may
differ. `--device cpu` runs the same on DRAM over UCX tcp/cma (the sandbox's check that the
script works; its figures are not the GPU's).

Usage (from the repository root): python benchmarks/experiments/nixl_split_gpu.py [--device cuda]
       [--blocks 512,2048] [--splits 1,2,4,8,16] [--ops READ,WRITE] [--reps 5] [--notif]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import sys
import time

import numpy as np
import torch

from loopserve.kv_transfer.nixl_agent import NixlKVWorker

BLOCK = (24, 2, 16, 16, 128)  # Ouro-1.4B's KV block: 24 layers x K/V x 16 tokens x 16 heads x 128 dims (3 MiB bf16)


def owner(conn, shape: tuple[int, ...], device: str) -> None:
    pool = torch.randn(shape, dtype=torch.bfloat16, device=device)
    w = NixlKVWorker("split-prefill", {"looped": pool}, BLOCK[2])
    conn.send(w.handshake_info())
    conn.recv()
    w.close()


def copy_s(dst: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    """Best host wall time of one copy, post to done (the clock the transfers are timed on)."""
    sync = torch.cuda.synchronize if dst.is_cuda else (lambda: None)
    best = float("inf")
    for _ in range(reps + 1):  # the first is a warm-up
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def transfer_s(w: NixlKVWorker, op: str, peer, ids: np.ndarray, k: int, reps: int, notif: bytes = b"") -> float:
    """Best wall time of `op` over `ids` (same ids on both sides) as k concurrent transfers,
    each carrying `notif` to the peer (the connector's READ carries one)."""
    best = float("inf")
    for _ in range(reps + 1):
        parts = np.array_split(ids, k)
        t0 = time.perf_counter()
        hs = [w.agent.make_prepped_xfer(op, w._dlist, q, peer.dlist, q, notif) for q in parts]
        for h in hs:
            if w.agent.transfer(h) == "ERR":
                raise RuntimeError(f"NIXL {op} failed to post")
        pending = list(hs)
        while pending:
            states = [(h, w.agent.check_xfer_state(h)) for h in pending]
            if any(s == "ERR" for _, s in states):
                raise RuntimeError(f"NIXL {op} failed")
            pending = [h for h, s in states if s != "DONE"]
        best = min(best, time.perf_counter() - t0)
        for h in hs:
            h.release()
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--blocks", default="512,2048")
    ap.add_argument("--splits", default="1,2,4,8,16")
    ap.add_argument("--ops", default="READ,WRITE")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--notif", action="store_true",
                    help="also time each op with a notification as the connector's READ sends")
    args = ap.parse_args()
    print("command: python " + " ".join(sys.argv), flush=True)
    counts = [int(c) for c in args.blocks.split(",")]
    shape = (max(counts), *BLOCK)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=owner, args=(b, shape, args.device))
    p.start()
    info = a.recv()
    local = torch.zeros(shape, dtype=torch.bfloat16, device=args.device)
    w = NixlKVWorker("split-decode", {"looped": local}, BLOCK[2])
    try:
        w.add_peer(info)
        peer = w._peers["split-prefill"]
        for count in counts:
            nbytes = count * local[0].numel() * local.element_size()
            scratch = torch.empty_like(local[:count])
            tc = copy_s(scratch, local[:count], args.reps)
            del scratch
            for op in args.ops.split(","):
                for k in (int(s) for s in args.splits.split(",")):
                    for notif in (b"", b'{"kind": "read", "ids": ["r"]}')[:1 + args.notif]:
                        t = transfer_s(w, op, peer, np.arange(count, dtype=np.int32), k, args.reps, notif)
                        tag = "+notif" if notif else ""
                        print(f"{count} blocks ({nbytes / 2**30:.2f} GiB) {op + tag:11s} k={k:2d}: "
                              f"{nbytes / t / 1e9:7.1f} GB/s vs copy {nbytes / tc / 1e9:7.1f} -> {tc / t:.2f}x",
                              flush=True)
    finally:
        a.send("stop")
        p.join(30)
        w.close()


if __name__ == "__main__":
    main()
