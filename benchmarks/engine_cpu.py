"""Continuous-depth batching (refill) vs fixed cohorts (no-refill) on CPU, adaptive exit.

Prints tokens/s for each policy measured in the same run and their ratio; `--sync-readback`
also runs refill with defer_readback off (each sample read before the next Operation: on a
CPU the device is the host, so this shows only what the deferred read-back costs the host).
Usage: python benchmarks/engine_cpu.py [--model tiny-ouro] [--requests 64] [--max-tokens 32] [--sync-readback]
"""

from __future__ import annotations

import argparse
import random
import sys
import time

import torch

from loopserve.engine.config import EngineConfig
from loopserve.engine.engine_core import EngineCore
from loopserve.model.registry import resolve_model
from loopserve.protocol.sampling_params import SamplingParams


def run(model, name: str, policy: str, args, defer: bool = True) -> tuple[float, dict]:
    cfg = EngineConfig(model=name, policy=policy, block_size=16, num_blocks=8192,
                       max_model_len=256, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=4096, defer_readback=defer)
    engine = EngineCore(cfg, model=model)
    rng = random.Random(0)
    for i in range(args.requests):
        prompt = [rng.randrange(256) for _ in range(rng.randint(4, 48))]
        engine.add_request(prompt, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True,
                                                  exit_threshold=args.exit_threshold,
                                                  max_loops=args.max_loops))
    t0 = time.perf_counter()
    tokens = 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    dt = time.perf_counter() - t0
    return tokens / dt, engine.stats().counters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-ouro")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=32)
    ap.add_argument("--max-loops", type=int, default=None)
    ap.add_argument("--exit-threshold", type=float, default=0.6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sync-readback", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    model = resolve_model(args.model, dtype=torch.float32, device=torch.device("cpu"), seed=0)
    results = {}
    runs = [("no_refill", "no_refill", True), ("refill", "refill", True)]
    if args.sync_readback:
        runs.append(("refill-sync", "refill", False))
    for label, policy, defer in runs:
        best = max((run(model, args.model, policy, args, defer) for _ in range(args.repeats)), key=lambda r: r[0])
        results[label] = best
        c = best[1]
        print(f"{label:11s} {best[0]:9.1f} tok/s  batches={c.batches}  loops_run={c.loops_run}")
    print(f"ratio refill/no_refill = {results['refill'][0] / results['no_refill'][0]:.2f}x")
    if args.sync_readback:
        print(f"ratio refill deferred/immediate read-back = {results['refill'][0] / results['refill-sync'][0]:.2f}x")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
