"""Scheduler cost per step (schedule + update) at 256, 1024 and 4096 live requests.

Every request is decoding (steady state, prompts done) with a token budget that fits all of
them, so each step's batch holds every request whose next Operation it is. Exits are
spread over depths 1..4 (refill mixes depths). Prints µs per scheduled request per step and
the growth ratio 4096/256 of that per-request cost (goal: <= 2 µs, ratio ~1 = linear total
cost).

Usage: python benchmarks/scheduler_overhead.py [--steps 300] [--policy refill] [--gc-off]
"""

from __future__ import annotations

import argparse
import gc
import sys
import time

from loopserve.intmath import cdiv
from loopserve.kv_cache import KVCacheManager, KVLayout
from loopserve.scheduler import (
    BatchResult,
    ItemResult,
    Operation,
    Scheduler,
    ScheduledBatch,
    SchedulerConfig,
    SchedRequest,
)

MAX_LOOPS = 4
MAX_TOKENS = 400  # never reached: the measurement stays in steady state


def fake_result(batch: ScheduledBatch) -> BatchResult:
    """Deterministic engine stand-in: position p exits at depth 1 + p % MAX_LOOPS."""
    op = batch.operation
    if op is Operation.PRELUDE:
        return BatchResult({i.request_id: ItemResult() for i in batch.items})
    if op is Operation.RECURRENT:
        return BatchResult({i.request_id: ItemResult(exited=tuple(p for p in i.positions
                                                                  if p % MAX_LOOPS < i.depth))
                            for i in batch.items})
    return BatchResult({i.request_id: ItemResult(sampled=(1,)) for i in batch.items})


def measure(n: int, steps: int, policy: str) -> float:
    blocks = cdiv(8 + MAX_TOKENS, 16)
    kv = KVCacheManager(KVLayout(16, n * MAX_LOOPS * blocks, n * blocks, True), incremental=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=8 * n, policy=policy,
                                      max_waiting=n), kv)
    for i in range(n):
        sched.add_request(SchedRequest(f"r{i}", 1 + i % 8, MAX_TOKENS, 1, MAX_LOOPS, priority=i % 3))
    for _ in range(60):  # warm up into steady-state decode
        b = sched.schedule().batch
        sched.update(b, fake_result(b))
    t_sched = 0.0
    scheduled = 0
    for _ in range(steps):
        t0 = time.perf_counter()
        b = sched.schedule().batch
        t_sched += time.perf_counter() - t0
        res = fake_result(b)  # the engine's work, not timed
        t0 = time.perf_counter()
        sched.update(b, res)
        t_sched += time.perf_counter() - t0
        scheduled += len(b.items)
    assert sched.has_unfinished(), "workload drained during the measurement"
    return t_sched / scheduled * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--policy", default="refill")
    ap.add_argument("--gc-off", action="store_true", help="disable the cyclic GC (its share of the cost)")
    args = ap.parse_args()
    if args.gc_off:
        gc.disable()
    res = {}
    for n in (256, 1024, 4096):
        res[n] = min(measure(n, args.steps, args.policy) for _ in range(5))  # least disturbed run
        print(f"{n:5d} live requests: {res[n]:.2f} us per scheduled request per step")
    print(f"growth ratio of the per-request cost 4096/256 = {res[4096] / res[256]:.2f} "
          "(1.0 = total cost linear in live requests)")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
