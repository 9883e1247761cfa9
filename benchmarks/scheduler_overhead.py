"""Scheduler cost per step (schedule + update) at 256, 1024 and 4096 live decode requests.

Prints µs per scheduled request per step and the growth ratio 4096/256 (goal: <= 2 µs and
linear growth, i.e. a per-request cost that stays flat).
Usage: python benchmarks/scheduler_overhead.py [--steps 200]
"""

from __future__ import annotations

import argparse
import sys
import time

from loopserve.kv_cache import KVCacheManager, KVLayout
from loopserve.scheduler import BatchResult, ItemResult, Operation, Scheduler, SchedulerConfig, SchedRequest


def measure(n: int, steps: int) -> float:
    kv = KVCacheManager(KVLayout(16, n * 4 * 8, n * 8, True), incremental=True)
    s = Scheduler(SchedulerConfig(max_num_seqs=n, max_num_batched_tokens=1 << 20, max_waiting=n,
                                  incremental_kv=True), kv)
    for i in range(n):
        s.add_request(SchedRequest(f"r{i}", 8, 1 << 20, 1, 4))
    # warm up into steady-state decode (every request past its prompt)
    empty = BatchResult({})
    for _ in range(20):
        b = s.schedule().batch
        s.update(b, BatchResult({it.request_id: ItemResult(exited=it.positions if it.depth >= 2 else (),
                                                           sampled=(1,) if b.operation is Operation.CODA else ())
                                 for it in b.items}))
    scheduled = 0
    t0 = time.perf_counter()
    for _ in range(steps):
        b = s.schedule().batch
        res = {it.request_id: ItemResult(exited=it.positions if it.depth >= 2 else (),
                                         sampled=(1,) if b.operation is Operation.CODA else ())
               for it in b.items} if b.operation is not Operation.PRELUDE else {}
        s.update(b, BatchResult(res) if res else empty)
        scheduled += len(b.items)
    dt = time.perf_counter() - t0
    return dt / scheduled * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()
    res = {}
    for n in (256, 1024, 4096):
        res[n] = min(measure(n, args.steps) for _ in range(3))
        print(f"{n:5d} live requests: {res[n]:.2f} us per scheduled request per step")
    print(f"growth ratio (per-request cost) 4096/256 = {res[4096] / res[256]:.2f}x  (1.0 = linear total cost)")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
