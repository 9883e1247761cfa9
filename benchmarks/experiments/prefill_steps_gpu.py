"""Where an 8k-token prefill's wall time goes on the GPU: per engine step (PRELUDE, 4 x
RECURRENT, CODA) the host time until step() returns, and the run's wall time, after a
warm-up run. A step whose host time exceeds its GPU work leaves the GPU idle (the profile's
GPU-busy time is the other side: `python benchmarks/gpu_h200.py --parts p`).

`--unfused-rope` rotates q and k with the compiled torch kernels and writes K/V unrotated,
as before RoPE was fused into the Triton slot write, for an A/B in one sitting.

Usage (from the repository root): PYTHONPATH=. python benchmarks/experiments/prefill_steps_gpu.py [--unfused-rope] [--runs 6]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from benchmarks.gpu_h200 import engine
from loopserve.model.attention import triton_backend
from loopserve.model.registry import resolve_model
from loopserve.protocol.sampling_params import SamplingParams


def unfuse_rope() -> None:
    fused = triton_backend.TritonAttention.forward

    def forward(self, q, k, v, cache, meta, scale, window=None, rot=None):
        if rot is not None:
            q, k = rot(q), rot(k)
        return fused(self, q, k, v, cache, meta, scale, window, None)

    triton_backend.TritonAttention.forward = forward


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--unfused-rope", action="store_true")
    ap.add_argument("--runs", type=int, default=6)
    ap.add_argument("--model", default="ouro-1.4b-shape")
    args = ap.parse_args()
    if args.unfused_rope:
        unfuse_rope()
    torch.manual_seed(0)
    model = resolve_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0)
    n = 8192
    e = engine(model, args.model, num_blocks=(n + 32) // 16 * 4 + 16, max_num_batched_tokens=n)
    prompt = [random.Random(1).randrange(1000, 40000) for _ in range(n)]
    for run in range(args.runs + 1):  # run 0 warms up (compiles)
        e.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True, exit_threshold=1.0))
        torch.cuda.synchronize()
        t0, host = time.perf_counter(), []
        while e.has_unfinished():
            a = time.perf_counter()
            e.step()
            host.append(time.perf_counter() - a)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        print(f"run {run}{' (warm-up)' if run == 0 else ''}: wall {wall * 1e3:.1f} ms; host ms per step "
              + " ".join(f"{h * 1e3:.1f}" for h in host), flush=True)
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
