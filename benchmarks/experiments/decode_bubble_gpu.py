"""Where a batch-1 decode token's wall time goes beyond GPU work: per Operation, host time
and the GPU's idle gap before each graph replay (CUDA events around every replay).

The engine's steps run as in serving (no profiler, no sync but the sample's read-back); the script
wraps `torch.cuda.CUDAGraph.replay` to record an event before and after it and times each
`EngineCore.step` on the host. Idle before a replay = time from the previous replay's end
to this one's start; the few eager kernels between replays (the sampler's argmax, output
copies: a few µs) count as idle, so it is an upper bound.

With `--defer-readback off` the host reads each sample before it launches the token's next
PRELUDE (the engine before defer_readback); the split of that gap is printed then.

Usage: python benchmarks/experiments/decode_bubble_gpu.py [--tokens 40] [--batch 1] [--fused-loop auto|off]
       [--defer-readback on|off]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict

import torch

from loopserve.engine.config import EngineConfig
from loopserve.engine.engine_core import EngineCore
from loopserve.engine.sampler import DrawnTokens
from loopserve.model.registry import resolve_model
from loopserve.protocol.sampling_params import SamplingParams


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def sample_gap(ops: list[str], steps: list[tuple[float, float]], marks: list, sampled: list[float]) -> None:
    """From a token's sample on the host to the next PRELUDE's replay (the GPU idles all along):
    the rest of the CODA step, the caller's gap between steps, the PRELUDE step before its replay."""
    after, between, before = [], [], []
    codas = iter(sampled)
    for k in range(len(ops) - 1):
        if ops[k] == "CODA" and ops[k + 1] == "PRELUDE":
            ts = next(codas)
            after.append((steps[k][1] - ts) * 1e6)
            between.append((steps[k + 1][0] - steps[k][1]) * 1e6)
            before.append((marks[k + 1][0] - steps[k + 1][0]) * 1e6)
        elif ops[k] == "CODA":
            next(codas)
    if after:
        print(f"sample on the host -> next PRELUDE replay (medians, µs): rest of the CODA step {med(after):.1f}, "
              f"between steps {med(between):.1f}, PRELUDE step before its replay {med(before):.1f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=40)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--fused-loop", default="auto")
    ap.add_argument("--model", default="ouro-1.4b-shape")
    ap.add_argument("--defer-readback", choices=("on", "off"), default="on")
    args = ap.parse_args()
    defer = args.defer_readback == "on"
    model = resolve_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0)
    e = EngineCore(EngineConfig(model=args.model, device="cuda", dtype="bfloat16", block_size=16,
                                num_blocks=args.batch * 4 * 24 + 64, max_model_len=384,
                                max_num_seqs=max(args.batch, 8), cuda_graphs=True, fused_loop=args.fused_loop,
                                defer_readback=defer), model=model)
    for i in range(args.batch):
        e.add_request(list(range(1000 + i, 1256 + i)),
                      SamplingParams(max_tokens=args.tokens + 20, ignore_eos=True, exit_threshold=1.0))
    for _ in range(60):  # prefill, graph captures, warm-up
        e.step()
    torch.cuda.synchronize()

    marks: list[tuple[float, torch.cuda.Event, torch.cuda.Event]] = []
    replay = torch.cuda.CUDAGraph.replay

    def timed_replay(graph):
        t = time.perf_counter()
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        replay(graph)
        after.record()
        marks.append((t, before, after))

    ops: list[str] = []
    execute = e._execute
    sampled: list[float] = []  # host clock when each CODA's sample reached the host (its one sync)
    samples = DrawnTokens.samples

    def traced_samples(self):
        first = self._samples is None
        out = samples(self)
        if first:
            sampled.append(time.perf_counter())
        return out

    def traced_execute(batch):
        ops.append(batch.operation.name)
        return execute(batch)

    torch.cuda.CUDAGraph.replay = timed_replay
    e._execute = traced_execute
    DrawnTokens.samples = traced_samples
    steps = []
    n_steps = 6 * args.tokens
    t_all = time.perf_counter()
    for _ in range(n_steps):
        t0 = time.perf_counter()
        e.step()
        steps.append((t0, time.perf_counter()))
    torch.cuda.synchronize()
    wall = time.perf_counter() - t_all
    torch.cuda.CUDAGraph.replay = replay
    DrawnTokens.samples = samples
    if len(marks) != len(steps) or len(ops) != len(steps):
        sys.exit(f"expected one replay per step: {len(marks)} replays, {len(ops)} ops, {len(steps)} steps")

    host, pre, gap, gpu = (defaultdict(list) for _ in range(4))
    for k, ((t0, t1), (tr, before, after), op) in enumerate(zip(steps, marks, ops)):
        host[op].append((t1 - t0) * 1e6)
        pre[op].append((tr - t0) * 1e6)
        gpu[op].append(before.elapsed_time(after) * 1e3)
        if k:
            gap[op].append(marks[k - 1][2].elapsed_time(before) * 1e3)
    print(f"batch {args.batch}, fused_loop={args.fused_loop}, defer_readback={args.defer_readback}: {wall / args.tokens * 1e3:.2f} ms/token over "
          f"{args.tokens} tokens; GPU in replays {sum(map(sum, gpu.values())) / args.tokens / 1e3:.2f} ms/token, "
          f"idle before replays {sum(map(sum, gap.values())) / args.tokens / 1e3:.2f} ms/token")
    print(f"{'operation':10s} {'steps':>5s} {'host step':>10s} {'host pre-replay':>16s} {'GPU idle before':>16s} "
          f"{'GPU replay':>11s}   (medians, µs)")

    for op in host:
        print(f"{op:10s} {len(host[op]):5d} {med(host[op]):10.1f} {med(pre[op]):16.1f} {med(gap[op]):16.1f} "
              f"{med(gpu[op]):11.1f}")
    if not defer:
        sample_gap(ops, steps, marks, sampled)
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
