"""Decode batch width: C requests decoding at once on the FakeEngine, measured in steps.

Shared by tests/scheduler/test_sched_batch_width.py (small C, every check on) and
benchmarks/batch_formation.py (the issue-41 table). The requests arrive together, the pool
holds all of them (full reservation), retire is synchronous (the engine's default), nobody
finishes inside the window. Adaptive exits are drawn from the histogram tiny-ouro gives at
exit_threshold 0.6.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Callable
from dataclasses import dataclass

from loopserve.intmath import cdiv
from loopserve.scheduler import Operation, Scheduler
from loopserve.scheduler.invariants import check_invariants
from tests.scheduler.fake_engine import FakeEngine
from tests.scheduler.helpers import add, make_scheduler

MAX_LOOPS = 4
BLOCK = 16
# Final exit depths of decode tokens, tiny-ouro (random weights, seed 0) at exit_threshold 0.6,
# 16 requests x 48 tokens: 1024-token prompts {1: 33, 2: 417, 3: 302}, 256-token prompts
# {1: 102, 2: 526, 3: 123, 4: 1}; pooled (mean 2.19).
EXIT_HISTOGRAM = {1: 135, 2: 943, 3: 425, 4: 1}
# The scheduler settings each registered policy runs with (mixed needs split prefill).
POLICY_CONFIG: dict[str, dict] = {"refill": {}, "no_refill": {"policy": "no_refill"},
                                  "priority": {"policy": "priority"},
                                  "mixed": {"policy": "mixed", "split_prefill": True}}


def exit_sampler(adaptive: bool) -> Callable[[random.Random, int, int], int]:
    depths, weights = list(EXIT_HISTOGRAM), list(EXIT_HISTOGRAM.values())

    def draw(rng: random.Random, lo: int, hi: int) -> int:
        return min(hi, max(lo, rng.choices(depths, weights)[0])) if adaptive else hi
    return draw


@dataclass
class Width:
    rows: dict[Operation, float]  # mean rows per batch of each Operation in the window
    tokens_per_step: float
    lockstep: float  # C / (mean exit depth + 2): every request in every batch
    tpot: tuple[float, float]  # p50, p99 of the gaps between a request's tokens, in steps (nan: none)
    ttft_max: int  # steps from arrival to the slowest first token
    max_wait: int  # most schedule steps an item ready after the last first token was passed over

    @property
    def ratio(self) -> float:
        return self.tokens_per_step / self.lockstep


def percentile(xs: list[int], q: float) -> float:
    if not xs:
        return math.nan
    xs = sorted(xs)
    return float(xs[min(len(xs) - 1, int(q * len(xs)))])


def measure(c: int, adaptive: bool, policy: str, prompt_len: int, steps: int, settle: int,
            seed: int = 0, budget: int = 2048, checks: bool = True, lag: int = 0,
            prepare: Callable[[Scheduler], None] | None = None) -> Width:
    """Run C requests to steady decode, then `settle` steps, then measure `steps` steps.
    `budget` (max_num_batched_tokens) sets how many prompts enter together; `lag`: batches
    retire up to this many steps late (1: the engine's async_scheduling); `checks`: the
    fake engine re-reads every item's context and the invariants are recounted after every
    prompt step (O(context) and O(blocks): off for the benchmark's thousands of positions;
    the invariants are recounted at the end either way); `prepare` may change the scheduler
    before the first step (the benchmark's old order)."""
    max_tokens = steps + settle + 64
    sched = make_scheduler(blocks=c * cdiv(prompt_len + max_tokens, BLOCK) * MAX_LOOPS, block_size=BLOCK,
                           max_num_seqs=c, max_num_batched_tokens=budget, max_waiting=max(c, 64),
                           **POLICY_CONFIG[policy])
    if prepare is not None:
        prepare(sched)
    e = FakeEngine(sched, seed=seed, finish_p=0.0, max_lag=lag, exit_depth=exit_sampler(adaptive),
                   check_context=checks)
    ids = [add(e, i, prompt_len=prompt_len, max_tokens=max_tokens,
               min_loops=1 if adaptive else MAX_LOOPS, max_loops=MAX_LOOPS) for i in range(c)]
    tracks = [e.tracks[r] for r in ids]
    done = 0  # schedule steps so far
    max_wait = 0

    def step(since: int | None = None):
        """One step; with `since`, the longest wait of items ready from step `since` on."""
        nonlocal done, max_wait
        b = e.step()
        done += 1
        if since is not None:
            for lane in sched.queues.lanes.values():
                for st in lane:
                    if st.ready_step >= since:
                        max_wait = max(max_wait, done - st.ready_step)
        return b

    first: dict[str, int] = {}
    while len(first) < c:
        step()
        for rid, t in zip(ids, tracks):
            if t.n_out and rid not in first:
                first[rid] = done
        assert done < 100_000, "prompts never finished"
        if checks:
            check_invariants(sched)
    decoding = done  # every request decodes from here on
    for _ in range(settle):
        step(decoding)
    rows: dict[Operation, list[int]] = {op: [] for op in Operation}
    tokens_at: dict[str, list[int]] = {r: [] for r in ids}
    depths: list[int] = []
    for s in range(steps):
        b = step(decoding)
        if b is None:  # everything in flight (lag): an idle step, counted
            continue
        rows[b.operation].append(b.num_rows)
        if b.operation is Operation.CODA:
            for item in b.items:
                if item.logits_positions:
                    tokens_at[item.request_id].append(s)
                    depths.append(e.tracks[item.request_id].exit_at[item.positions[-1]])
    check_invariants(sched)
    gaps = [b - a for ts in tokens_at.values() for a, b in zip(ts, ts[1:])]
    mean_depth = statistics.fmean(depths) if depths else float(MAX_LOOPS)
    return Width({op: statistics.fmean(v) if v else 0.0 for op, v in rows.items()},
                 sum(map(len, tokens_at.values())) / steps, c / (mean_depth + 2),
                 (percentile(gaps, 0.5), percentile(gaps, 0.99)), max(first.values()), max_wait)
