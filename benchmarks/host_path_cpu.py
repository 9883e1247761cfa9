"""Host time of turning a scheduled batch into device input (CPU, pure host work).

On the H200 an 8k-token prefill is host-bound: the GPU has nothing to run while the host
builds the PRELUDE and the first RECURRENT batch (`benchmarks/experiments/prefill_steps_gpu.py`). This
times those host pieces alone — `ModelRunner._batch` (its rows' state slab rows included) +
the packed copy (`HostBatch.to`, here to CPU), and assigning a fresh request's slab rows —
for an 8192-row prefill chunk and a 256-request decode batch, per row, against the cost of
only materialising the same rows' positions as a tensor (the floor of any per-row host
work), measured in the same run.

Usage: python benchmarks/host_path_cpu.py [--rows 8192] [--decode 256] [--repeat 30]
"""

from __future__ import annotations

import argparse
import sys
import timeit

import torch

from loopserve.engine.model_runner import ModelRunner
from loopserve.engine.request import Request
from loopserve.intmath import cdiv
from loopserve.kv_cache import BlockTable, KVLayout
from loopserve.model.registry import resolve_model
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.scheduler import BatchItem, Operation, ScheduledBatch, WorkKey


def _best_us(fn, repeat: int) -> float:
    return min(timeit.repeat(fn, number=1, repeat=repeat)) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    model = resolve_model("tiny-ouro", dtype=torch.float32, device="cpu", seed=0)
    bs, n, planes = 16, args.rows, model.max_loops
    nblk = cdiv(n, bs) + 1
    runner = ModelRunner(model, KVLayout(bs, planes * nblk * (args.decode + 1)), torch.float32, torch.device("cpu"))
    reqs, tables, free = {}, {}, iter(range(10 ** 9))
    for i in range(args.decode + 1):
        length = n if i == 0 else 300
        reqs[f"r{i}"] = Request(f"r{i}", list(range(length)), SamplingParams(), i, None)
        w = cdiv(length + 1, bs)
        tables[f"r{i}"] = BlockTable([], [[next(free) for _ in range(w)] for _ in range(planes)])
    prompt = tuple(range(n))
    cases = {
        f"prefill PRELUDE {n} rows": (ScheduledBatch(0, Operation.PRELUDE, (BatchItem("r0", WorkKey.PROMPT_PRELUDE, prompt),)), True, n),
        f"prefill RECURRENT {n} rows": (ScheduledBatch(1, Operation.RECURRENT, (BatchItem("r0", WorkKey.PROMPT_RECURRENT, prompt, 1),)), False, n),
        f"decode RECURRENT {args.decode} requests": (ScheduledBatch(2, Operation.RECURRENT, tuple(
            BatchItem(f"r{i}", WorkKey.DECODE_RECURRENT, (300,), 2) for i in range(1, args.decode + 1))), False, args.decode),
    }
    for batch, _, _ in cases.values():  # the rows a RECURRENT batch looks up (a PRELUDE assigned them)
        runner.states.rows([(i.request_id, list(i.positions)) for i in batch.items], assign=True)
    cpu = torch.device("cpu")
    print(f"{'case':36s} {'batch+copy us':>14s} {'us/row':>7s} {'state rows us':>14s} {'floor us':>9s} {'x floor':>8s}")
    for name, (batch, tokens, rows) in cases.items():
        t_batch = _best_us(lambda: runner._batch(batch, reqs, tables, with_tokens=tokens).to(cpu), args.repeat)

        def assign():  # a fresh request's rows, as its PRELUDE takes them
            runner.states.rows([("fresh-" + i.request_id, list(i.positions)) for i in batch.items], assign=True)
            for i in batch.items:
                runner.states.drop("fresh-" + i.request_id)

        t_rows = _best_us(assign, args.repeat)
        positions = [p for i in batch.items for p in i.positions]
        t_floor = _best_us(lambda: torch.tensor(positions), args.repeat)
        print(f"{name:36s} {t_batch:14.0f} {t_batch / rows:7.2f} {t_rows:14.0f} {t_floor:9.0f} "
              f"{(t_batch + t_rows) / t_floor:8.1f}")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
