"""Compile the fused loop kernel for sm_90 without a GPU, as the GPU's JIT would
(loopserve/model/fused_loop/offline.py), and print its registers, spills, shared memory and
how it loads the GEMVs' weights: how many programs an SM can hold, and whether W streams in
16-byte loads. Counts are this sandbox's Triton version's (the device's may differ).

Usage: python benchmarks/fused_loop_regs.py [ROWSxBLOCK_KxWARPS ...] [--mode 0-3] [--stages 3]
       [--prefetch-kib 0] [--w-ahead 1] [--prefetch-own] [--min-row-tile 1] [--model ouro-1.4b-shape] [--sass FILE]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)  # compile for the GPU, not for the interpreter

from loopserve.model.fused_loop.offline import (  # noqa: E402
    H200_SMS, async_copies, compile_for_hopper, meta_model, resource_usage, sass, weight_loads,
)
from loopserve.model.fused_loop.ouro_loop import OuroFusedLoop  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("configs", nargs="*", default=["1x512x16"], help="ROWSxBLOCK_KxWARPS")
    ap.add_argument("--mode", type=int, default=0, help="GEMV mode (kernel.py's _linear MODE)")
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--prefetch-kib", type=int, default=0)
    ap.add_argument("--w-ahead", type=int, default=1, help="W chunks loaded ahead in GEMV mode 0 (1 or 2)")
    ap.add_argument("--prefetch-own", action="store_true", help="each GEMV tile prefetches the next into L2")
    ap.add_argument("--min-row-tile", type=int, default=1, help="GEMV tiles of at least this many rows")
    ap.add_argument("--model", default="ouro-1.4b-shape")
    ap.add_argument("--sass", help="write the last config's SASS to this file")
    args = ap.parse_args()
    print("command: python " + " ".join(sys.argv), flush=True)
    model = meta_model(args.model)
    for c in args.configs:
        rows, bk, warps = (int(v) for v in c.split("x"))
        fused = OuroFusedLoop(model, max_rows=rows, num_programs=H200_SMS, use_barrier=True, block_k=bk,
                              num_warps=warps, prefetch_kib=args.prefetch_kib, gemv_mode=args.mode,
                              num_stages=args.stages, w_ahead=args.w_ahead,
                              prefetch_own=args.prefetch_own, min_row_tile=args.min_row_tile)
        kernel = compile_for_hopper(fused, rows)
        u = resource_usage(kernel)
        print(f"rows={rows} BK={bk} warps={warps} mode={args.mode} stages={args.stages} "
              f"prefetch={args.prefetch_kib} KiB w_ahead={args.w_ahead} prefetch_own={args.prefetch_own} min_row_tile={args.min_row_tile}: {u['REG']} registers, {u['STACK']} B stack, {u['LOCAL']} B local, "
              f"{kernel.metadata.shared} B shared; weight loads {dict(weight_loads(kernel))}; "
              f"copies into shared memory {async_copies(kernel)}", flush=True)
        if args.sass:
            with open(args.sass, "w") as f:
                f.write(sass(kernel))


if __name__ == "__main__":
    main()
