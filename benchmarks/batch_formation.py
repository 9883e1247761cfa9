"""Batch width at C live decoding requests: the width-aware plan order against the old order.

Drives the real Scheduler with the scheduler tests' FakeEngine (tests/scheduler/fake_engine.py):
it executes every batch on its simulated paged KV store and checks each row's loop depth and
each request's tokens, so the measured schedule is one the engine accepts, and it runs in
seconds where the real tiny engine would spend minutes of CPU per configuration on model
math that does not change which batches form (the width is a property of the scheduler).
Its whole-context re-read per item is off (O(context) per item at 1024 positions).

Workload (issue 41): C requests with 1024-token prompts (256 at C = 256) arrive at once, the
pool holds all of them (full reservation), max_num_seqs = C, max_num_batched_tokens = 2048
(the engine's default: atomic prompts enter two at a time; mixed: split prefill, 256-token
chunks), synchronous retire (the engine's default, async_scheduling off). After the last
first token, `--settle` steps, then `--steps` measured steps. Depth: fixed 4 loops, or
adaptive exit with final exits drawn from the histogram tiny-ouro gives at exit_threshold
0.6 (`EXIT_HISTOGRAM`, mean ~2.2). Every registered policy (priority with equal priorities).

Prints per row: mean rows per batch of each Operation, output tokens per step and its ratio
to lockstep (C / (mean exit depth + 2): every request in every batch), TPOT p50/p99 in
steps (gaps between a request's tokens), the slowest first token (steps from arrival), for
the width-aware order and the old one (oldest lane first, round robin by plan age; 65f2345,
reproduced here), and the ratios new/old.

Usage: python benchmarks/batch_formation.py [--sizes 8 32 64 128 256] [--steps 120] [--settle 60]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' fake engine

from loopserve.intmath import cdiv  # noqa: E402
from loopserve.scheduler import Operation, Scheduler  # noqa: E402
from loopserve.scheduler.invariants import check_invariants  # noqa: E402
from loopserve.scheduler.policy import MIXED_RECURRENT, POLICIES, Plan, Policy  # noqa: E402
from loopserve.scheduler.queues import WorkQueues  # noqa: E402
from tests.scheduler.fake_engine import FakeEngine  # noqa: E402
from tests.scheduler.helpers import add, make_scheduler  # noqa: E402

MAX_LOOPS = 4
BLOCK = 16
# Final exit depths of decode tokens, tiny-ouro (random weights, seed 0) at exit_threshold 0.6,
# 16 requests x 48 tokens: 1024-token prompts {1: 33, 2: 417, 3: 302}, 256-token prompts
# {1: 102, 2: 526, 3: 123, 4: 1}; pooled.
EXIT_HISTOGRAM = {1: 135, 2: 943, 3: 425, 4: 1}
POLICY_CONFIG = {"refill": {}, "no_refill": {"policy": "no_refill"}, "priority": {"policy": "priority"},
                 "mixed": {"policy": "mixed", "split_prefill": True}}


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
    """Swap the scheduler's plan order for the old one (mixed keeps its recurrent-first rule)."""
    policy: Policy = sched.policy
    mixed = sched.config.policy == "mixed"

    def order(queues: WorkQueues, served: dict[Plan, int], step: int, max_wait: int) -> list[Plan]:
        plans = old_order(policy.plans, queues, served)
        if mixed:
            if all(len(queues.lanes[lane]) for lane in MIXED_RECURRENT.lanes):
                plans.remove(MIXED_RECURRENT)
                plans.insert(0, MIXED_RECURRENT)
        return plans

    policy.order_plans = order  # type: ignore[method-assign]


def exit_sampler(adaptive: bool):
    depths, weights = list(EXIT_HISTOGRAM), list(EXIT_HISTOGRAM.values())

    def draw(rng: random.Random, lo: int, hi: int) -> int:
        return min(hi, max(lo, rng.choices(depths, weights)[0])) if adaptive else hi
    return draw


@dataclass
class Result:
    rows: dict[Operation, float]  # mean rows per batch of each Operation
    tokens_per_step: float
    lockstep: float
    tpot: tuple[float, float]  # p50, p99 in steps
    ttft_max: int
    steps: int  # total schedule steps of the run

    @property
    def ratio(self) -> float:
        return self.tokens_per_step / self.lockstep


def pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return float(xs[min(len(xs) - 1, int(q * len(xs)))])


def run(c: int, adaptive: bool, policy: str, old: bool, args) -> Result:
    plen = args.long_prompt if c < 256 else args.short_prompt
    max_tokens = args.steps + args.settle + 64  # nobody finishes before the window closes
    per_req = cdiv(plen + max_tokens, BLOCK)
    sched = make_scheduler(blocks=c * per_req * MAX_LOOPS, block_size=BLOCK, max_num_seqs=c,
                           max_num_batched_tokens=2048, max_waiting=max(c, 64), **POLICY_CONFIG[policy])
    if old:
        use_old_order(sched)
    e = FakeEngine(sched, seed=args.seed, finish_p=0.0, max_lag=0, exit_depth=exit_sampler(adaptive),
                   check_context=False)
    ids = [add(e, i, prompt_len=plen, max_tokens=max_tokens, min_loops=1 if adaptive else MAX_LOOPS,
               max_loops=MAX_LOOPS) for i in range(c)]
    tracks = [e.tracks[r] for r in ids]
    first: dict[str, int] = {}
    step = 0
    while len(first) < c:
        e.step()
        step += 1
        for rid, t in zip(ids, tracks):
            if t.n_out and rid not in first:
                first[rid] = step
        assert step < 100_000, "prompts never finished"
    for _ in range(args.settle):
        e.step()
    rows: dict[Operation, list[int]] = {op: [] for op in Operation}
    tokens_at: dict[str, list[int]] = {r: [] for r in ids}
    depths: list[int] = []
    for s in range(args.steps):
        b = e.step()
        assert b is not None, "an idle step with every request decoding"
        rows[b.operation].append(b.num_rows)
        if b.operation is Operation.CODA:
            for item in b.items:
                if item.logits_positions:
                    t = e.tracks[item.request_id]
                    tokens_at[item.request_id].append(s)
                    depths.append(t.exit_at[item.positions[-1]])
    check_invariants(sched)
    gaps = [b - a for ts in tokens_at.values() for a, b in zip(ts, ts[1:])]
    ntok = sum(map(len, tokens_at.values()))
    mean_depth = statistics.fmean(depths)
    return Result({op: statistics.fmean(v) if v else 0.0 for op, v in rows.items()}, ntok / args.steps,
                  c / (mean_depth + 2), (pct(gaps, 0.5), pct(gaps, 0.99)), max(first.values()),
                  step + args.settle + args.steps)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", type=int, nargs="+", default=[8, 32, 64, 128, 256])
    ap.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--settle", type=int, default=60)
    ap.add_argument("--long-prompt", type=int, default=1024)
    ap.add_argument("--short-prompt", type=int, default=256, help="prompt length at C >= 256")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    assert set(POLICIES) == set(POLICY_CONFIG), "a registered policy has no benchmark config"
    t0 = time.perf_counter()
    print("order: new = width-aware (max_wait_steps 12), old = oldest lane first (65f2345)")
    print(f"{'policy':9} {'depth':8} {'C':>4} {'order':5} {'P rows':>7} {'R rows':>7} {'C rows':>7} "
          f"{'tok/step':>8} {'/lock':>6} {'TPOT50':>6} {'TPOT99':>6} {'TTFTmax':>7}   new/old: tok  TPOT99")
    worst = {False: 9.0, True: 9.0}
    for policy in args.policies:
        for adaptive in (False, True):
            for c in args.sizes:
                res = {old: run(c, adaptive, policy, old, args) for old in (False, True)}
                for old in (False, True):
                    r = res[old]
                    tail = ""
                    if old:
                        n = res[False]
                        tail = f"   {n.tokens_per_step / r.tokens_per_step:5.2f}  {n.tpot[1] / r.tpot[1]:5.2f}"
                    print(f"{policy:9} {'adaptive' if adaptive else 'fixed 4':8} {c:4d} "
                          f"{'old' if old else 'new':5} {r.rows[Operation.PRELUDE]:7.1f} "
                          f"{r.rows[Operation.RECURRENT]:7.1f} {r.rows[Operation.CODA]:7.1f} "
                          f"{r.tokens_per_step:8.2f} {r.ratio:6.2f} {r.tpot[0]:6.0f} {r.tpot[1]:6.0f} "
                          f"{r.ttft_max:7d}{tail}")
                worst[adaptive] = min(worst[adaptive], res[False].ratio)
    print(f"worst new tokens per step / lockstep: fixed depth {worst[False]:.2f} (goal 0.95), "
          f"adaptive {worst[True]:.2f} (goal 0.80); {time.perf_counter() - t0:.0f} s")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
