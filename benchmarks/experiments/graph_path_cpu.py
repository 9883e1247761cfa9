"""Which batches of throughput.py's closed-loop cell take the CUDA-graph path, on CPU.

The padded graph path (`ModelRunner.use_graphs(capture=False)`) runs on tiny-ouro at the
cell's shape; every batch is classed as decode-shaped (`DecodeGraphs.applies`: a replay on a
GPU) or eager (prompt rows), per Operation, and each graph key (slab version, Operation,
padded size, context bucket) the timed cell meets that the warm-up did not is counted (a GPU
would capture it there). `--warm-order smallest` runs throughput.py's warm-up smallest size
first (its order before 765f242), whose slab growths drop the graphs captured before them.

PYTHONPATH=. python benchmarks/experiments/graph_path_cpu.py [--c 32] [--prompt-len 1024]
    [--output-len 128] [--policy refill] [--warm-order largest|smallest]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import throughput  # noqa: E402

from loopserve.engine.config import EngineConfig  # noqa: E402
from loopserve.engine.engine_core import EngineCore  # noqa: E402
from loopserve.intmath import cdiv  # noqa: E402


def run(a: argparse.Namespace, mode: str) -> None:
    max_len = a.prompt_len + a.output_len + 16
    engine = EngineCore(EngineConfig(
        model="tiny-ouro", device="cpu", dtype="float32", block_size=16, max_model_len=max_len, seed=0,
        num_blocks=2 * a.c * cdiv(max_len, 16) * 4 + 64,
        scheduler={"max_num_seqs": a.c, "max_num_batched_tokens": 16384, "policy": a.policy,
                   "split_prefill": a.policy == "mixed"}))
    engine.runner.use_graphs(a.c, cdiv(max_len, 16), capture=False)
    graphs = engine.runner.graphs
    seen: set = set()
    timed = {"on": False, "new": 0}
    eager, eager_rows = Counter(), Counter()
    forward, graph_run = engine.runner._forward, graphs.run

    def classify(hb):
        if timed["on"] and not graphs.applies(hb):
            eager[hb.operation.value] += 1
            eager_rows[hb.operation.value] += hb.num_rows
        return forward(hb)

    def run_keyed(hb, fn, slab_version):
        def keyed(mb):  # the padded batch run() built: its rows and context bucket are the key's
            key = (slab_version, hb.operation, mb.positions.numel(), mb.attn.max_context_len)
            if key not in seen:
                seen.add(key)
                timed["new"] += timed["on"]
            return fn(mb)

        return graph_run(hb, keyed, slab_version)

    engine.runner._forward, graphs.run = classify, run_keyed
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 250) for _ in range(a.prompt_len)] for _ in range(2 * a.c)]
    args = argparse.Namespace(exit_threshold=0.6)
    table = argparse.Namespace(engine=engine, args=args, max_loops=engine.max_loops)
    throughput.warm_up(table, prompts, a.c)
    timed["on"] = True
    b0, runs0 = Counter(engine.counters.batches), graphs.runs
    throughput.closed_loop(engine, prompts, [throughput.params(mode, args, engine.max_loops, a.output_len)]
                           * (2 * a.c), a.c, math.inf)
    batches = Counter(engine.counters.batches)
    batches.subtract(b0)
    rows = {op: round(eager_rows[op] / n, 1) for op, n in eager.items()}
    print(f"{a.policy} {mode} C={a.c} P={a.prompt_len} out={a.output_len} warm-up {a.warm_order} first: "
          f"batches {dict(batches)}, {graphs.runs - runs0} decode-shaped, eager {dict(eager)} "
          f"(rows per eager batch {rows}); graph keys new in the timed cell: {timed['new']}", flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--c", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--policy", default="refill")
    p.add_argument("--warm-order", choices=("largest", "smallest"), default="largest")
    a = p.parse_args()
    torch.set_num_threads(2)
    if a.warm_order == "smallest":
        largest_first = throughput.warm_sizes
        throughput.warm_sizes = lambda table, c: sorted(largest_first(table, c))
    print("command: python", " ".join(sys.argv))
    for mode in ("fixed", "adaptive"):
        run(a, mode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
