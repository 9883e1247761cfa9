"""Batch width at C live decoding requests: the width-aware plan order against the old order.

Drives the real Scheduler with the scheduler tests' FakeEngine (tests/scheduler/decode_width.py):
it executes every batch on its simulated paged KV store and checks each row's loop depth and
each request's tokens, so every measured schedule is one an engine accepts, and a
configuration takes a second or two where the real tiny engine would spend minutes of CPU on
model math that does not change which batches form (the width is the scheduler's doing). Its
re-read of every item's whole context is off here (O(context) per item, thousands of
positions), and so is the invariant recount after every prompt step (once at the end); the
default suite's test_sched_batch_width.py runs the same workload with both on.

Workload (issue 41): C requests with 1024-token prompts (256 at C >= 256) arrive at once, the
pool holds all of them (full reservation), max_num_seqs = C, max_num_batched_tokens = 2048
(the engine's default: atomic prompts enter two at a time, so decode starts in groups; mixed:
split prefill, 256-token chunks), synchronous retire (the engine's default; --lag 1: a batch
retires 0 or 1 steps late, as with async_scheduling). After the last
first token, --settle steps, then --steps measured steps. Depth: fixed 4 loops, or adaptive
exit with final exits drawn from tiny-ouro's histogram at exit_threshold 0.6 (mean 2.19).
Every registered policy (priority with equal priorities).

Prints per row: mean rows per batch of each Operation, output tokens per step and its ratio to
lockstep (C / (mean exit depth + 2)), TPOT p50/p99 in steps (gaps between a request's tokens;
'-' when no request made two tokens in the window), the slowest first token (steps from
arrival) and the longest wait of any item (schedule steps passed over), for the width-aware
order (new) and the order before it (old: oldest lane first, round robin by plan age, as at
65f2345, reproduced below), and the ratios new/old.

Usage: python benchmarks/batch_formation.py [--sizes 8 32 64 128 256] [--steps 120] [--settle 60]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' fake engine

from loopserve.scheduler import Operation, Scheduler  # noqa: E402
from loopserve.scheduler.policy import MIXED_RECURRENT, POLICIES, Plan  # noqa: E402
from loopserve.scheduler.queues import WorkQueues  # noqa: E402
from tests.scheduler.decode_width import POLICY_CONFIG, Width, measure  # noqa: E402


def old_order(plans: tuple[Plan, ...], queues: WorkQueues, served: dict[Plan, int]) -> list[Plan]:
    """The plan order before width-aware formation (Policy.order_plans at 65f2345)."""
    lanes = queues.lanes
    scored = []
    for plan in plans:
        ready = [lanes[lane] for lane in plan.lanes if len(lanes[lane])]
        if not ready:
            continue
        age = max(min(q.head().ready_tick for q in ready), served.get(plan, -1))
        scored.append(((min(q.head_rank() for q in ready), age, plan.stage), plan))
    scored.sort(key=lambda s: s[0])
    return [p for _, p in scored]


def use_old_order(sched: Scheduler) -> None:
    """Give this scheduler the old plan order (mixed keeps its recurrent-first rule)."""
    plans, mixed = sched.policy.plans, sched.config.policy == "mixed"

    def order(queues: WorkQueues, served: dict[Plan, int], step: int, max_wait: int) -> list[Plan]:
        ordered = old_order(plans, queues, served)
        if mixed and all(len(queues.lanes[lane]) for lane in MIXED_RECURRENT.lanes):
            ordered.remove(MIXED_RECURRENT)
            ordered.insert(0, MIXED_RECURRENT)
        return ordered

    sched.policy.order_plans = order  # type: ignore[method-assign]


def fmt(x: float) -> str:
    return "-" if math.isnan(x) else f"{x:.0f}"


def line(policy: str, adaptive: bool, c: int, label: str, r: Width) -> str:
    return (f"{policy:9} {'adaptive' if adaptive else 'fixed 4':8} {c:4d} {label:5} "
            f"{r.rows[Operation.PRELUDE]:6.1f} {r.rows[Operation.RECURRENT]:6.1f} {r.rows[Operation.CODA]:6.1f} "
            f"{r.tokens_per_step:8.2f} {r.ratio:6.2f} {fmt(r.tpot[0]):>6} {fmt(r.tpot[1]):>6} "
            f"{r.ttft_max:7d} {r.max_wait:5d}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 64, 128, 256])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--settle", type=int, default=60)
    ap.add_argument("--long-prompt", type=int, default=1024)
    ap.add_argument("--short-prompt", type=int, default=256, help="prompt length at C >= 256")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lag", type=int, default=0, help="1: retire a step late at random (async_scheduling)")
    args = ap.parse_args()
    assert set(POLICIES) == set(POLICY_CONFIG), "a registered policy has no benchmark config"
    t0 = time.perf_counter()
    print(f"new = width-aware order (max_wait_steps 12), old = oldest lane first (65f2345); lag {args.lag}")
    print(f"{'policy':9} {'depth':8} {'C':>4} {'order':5} {'P rows':>6} {'R rows':>6} {'C rows':>6} "
          f"{'tok/step':>8} {'/lock':>6} {'TPOT50':>6} {'TPOT99':>6} {'TTFTmax':>7} {'wait':>5}"
          "   new/old: tok/step TPOT99")
    worst = {False: math.inf, True: math.inf}
    for policy in args.policies:
        for adaptive in (False, True):
            for c in args.sizes:
                plen = args.long_prompt if c < 256 else args.short_prompt
                new, old = (measure(c, adaptive, policy, plen, args.steps, args.settle, args.seed,
                                    checks=False, lag=args.lag, prepare=use_old_order if o else None)
                            for o in (False, True))
                print(line(policy, adaptive, c, "new", new))
                print(line(policy, adaptive, c, "old", old)
                      + f"   {new.tokens_per_step / old.tokens_per_step:8.2f} {new.tpot[1] / old.tpot[1]:6.2f}")
                worst[adaptive] = min(worst[adaptive], new.ratio)
    print(f"worst new tokens per step / lockstep: fixed depth {worst[False]:.2f} (goal 0.95), "
          f"adaptive {worst[True]:.2f} (goal 0.80); {time.perf_counter() - t0:.0f} s")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
