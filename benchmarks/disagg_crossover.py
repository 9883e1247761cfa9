"""Per-request disaggregation crossover (issue 29): prefill time of n uncached tokens on the
decode worker's engine vs the NIXL READ of those n tokens' KV planes from a prefill engine.

Below the crossover a decode worker prefilling the prompt itself costs it less than reading
the KV would; the router's `local_prefill_tokens` default comes from here. Two real engines of
the cluster config in two processes (prefill role spawned, decode role here) and two real NIXL
agents; loopserve/bench/crossover.py says exactly what each column times. Prints the command,
the machine, a table (n, prefill ms, transfer ms, transfer/prefill) and the crossover: the
smallest n with prefill >= transfer, interpolated between measured points, or where it lies
outside them. Lengths past the config's max_model_len are cut to it (--max-model-len raises
it; the model's positions must allow it).

Usage: python benchmarks/disagg_crossover.py [--config configs/cpu-1p1d.yaml]
       [--lengths 16,32,64,128,256,512,1024] [--reps 7] [--warmup 1] [--model NAME]
       [--max-model-len N] [--num-blocks N] [--json out/crossover.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from loopserve.bench.crossover import (
    DEFAULT_LENGTHS,
    HANDOFF_TOKENS,
    HEADER,
    crossover,
    describe_engine,
    lengths_for,
    load_config,
    machine,
    measure,
    result_json,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/cpu-1p1d.yaml"))
    p.add_argument("--lengths", default=",".join(map(str, DEFAULT_LENGTHS)),
                   help="prompt lengths, comma separated")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1, help="untimed runs at each length first")
    p.add_argument("--model", default=None, help="override the config's engine.model")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size (not the block geometry)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = p.parse_args()
    t0 = time.perf_counter()
    command = " ".join(["python", *sys.argv])
    cluster = load_config(args.config, args.model, args.max_model_len, args.num_blocks)
    print("command:", command)
    print("machine:", machine())
    print("engine: ", describe_engine(cluster))
    print(f"median of {args.reps} after {args.warmup} warm-up; prefill at full loop depth, batch of one")
    wanted = [int(n) for n in args.lengths.split(",")]
    if cut := sorted(set(wanted) - set(lengths_for(cluster.engine_config("decode"), wanted))):
        print(f"lengths {cut} cut to max_model_len - {HANDOFF_TOKENS} (--max-model-len raises it)")
    print(HEADER, flush=True)
    rows = measure(cluster, wanted, reps=args.reps, warmup=args.warmup,
                   seed=args.seed, log=lambda line: print(line, flush=True))
    cross = crossover(rows)
    wall = time.perf_counter() - t0
    print(f"crossover (smallest n with prefill >= transfer): {cross['text']}")
    print(f"wall time {wall:.1f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result_json(
            rows, cross, command=command, machine=machine(), engine=describe_engine(cluster),
            config=str(args.config), reps=args.reps, warmup=args.warmup, wall_s=wall), indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
