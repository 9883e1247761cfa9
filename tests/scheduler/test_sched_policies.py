"""Policies: every one drains; refill mixes depths; no_refill runs cohorts; mixed forms mixed
batches (recurrent first); priority orders work; decode is never starved by prompts."""

import pytest

from loopserve.scheduler import Operation, WorkKey
from loopserve.scheduler.invariants import check_invariants
from loopserve.scheduler.policy import POLICIES
from loopserve.scheduler.types import FIXED_OPERATION
from tests.scheduler.helpers import POLICY_CONFIGS, add, engine_for

K = WorkKey


def test_every_registered_policy_has_a_config_the_policy_tests_run():
    assert {c.get("policy", "refill") for c in POLICY_CONFIGS.values()} == set(POLICIES)


@pytest.mark.parametrize("cfg", list(POLICY_CONFIGS))
def test_every_policy_drains_within_budget_and_slots(cfg):
    e = engine_for(seed=1, finish_p=0.1, max_num_seqs=4, max_num_batched_tokens=16, **POLICY_CONFIGS[cfg])
    for i in range(12):
        add(e, i, prompt_len=1 + (i * 5) % 11, max_tokens=1 + i % 6, min_loops=1 + i % 2,
            max_loops=2 + i % 3, priority=i % 3)
    while e.sched.has_unfinished() or e.pipeline:
        e.step()
        check_invariants(e.sched)
        assert len(e.sched.admission_slots) <= 4
    assert set(e.finished) == set(e.tracks)
    for b in e.batches:
        assert b.num_rows <= 16 or (len(b.items) == 1 and b.items[0].work_key is K.PROMPT_ATOMIC)
        assert all(FIXED_OPERATION.get(i.work_key, b.operation) is b.operation for i in b.items)
        if cfg != "mixed":
            assert len(b.work_keys) == 1, f"{cfg}: only mixed combines work keys: {b.work_keys}"


def test_refill_lets_new_tokens_join_deeper_ones():
    e = engine_for(seed=3, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(6):
        add(e, i, prompt_len=1, max_tokens=20, min_loops=1, max_loops=4)
    e.drain()
    mixed_depths = [b for b in e.batches if b.operation is Operation.RECURRENT
                    and b.work_keys == {K.DECODE_RECURRENT} and {1, 4} <= {i.depth for i in b.items}]
    assert mixed_depths, "a token beginning loop 1 should run beside one beginning loop 4"


def test_no_refill_runs_each_cohort_to_its_end():
    e = engine_for(seed=3, max_num_seqs=8, max_num_batched_tokens=64, policy="no_refill")
    for i in range(6):
        add(e, i, prompt_len=1, max_tokens=20, min_loops=1, max_loops=4)
    e.drain()
    decode = [b for b in e.batches if b.work_keys == {K.DECODE_RECURRENT}]
    assert all(len({i.depth for i in b.items}) == 1 for b in decode), "a cohort loops in lockstep"
    # a cohort's loops form one run of batches at depth 1, 2, ...: a new cohort starts at 1 only
    # after the previous one has no rows left
    depth_runs = [b.items[0].depth for b in decode]
    assert all(d2 in (d1 + 1, 1) for d1, d2 in zip(depth_runs, depth_runs[1:]))
    assert set(e.finished) == set(e.tracks)


def mixed_engine(**kw):
    return engine_for(seed=2, max_num_seqs=8, max_num_batched_tokens=32, policy="mixed",
                      split_prefill=True, prefill_chunk_size=4, **kw)


def test_mixed_policy_forms_both_mixed_batches():
    e = mixed_engine()
    add(e, 0, prompt_len=2, max_tokens=40, max_loops=3)
    for _ in range(12):  # r0 is decoding
        e.step()
    add(e, 1, prompt_len=40, max_tokens=2, max_loops=3)
    e.drain()
    kinds = {(b.operation, b.work_keys) for b in e.batches}
    assert (Operation.PRELUDE, frozenset({K.DECODE_PRELUDE, K.PROMPT_PRELUDE})) in kinds
    assert (Operation.RECURRENT, frozenset({K.DECODE_RECURRENT, K.PROMPT_RECURRENT})) in kinds
    mixed = [b for b in e.batches if len(b.work_keys) == 2]
    # decode rows take the budget first, the chunk fills what is left
    assert all(b.items[0].work_key in (K.DECODE_PRELUDE, K.DECODE_RECURRENT) for b in mixed)


def test_mixed_recurrent_batch_comes_first_when_both_recurrent_queues_are_ready():
    e = mixed_engine()
    for i in range(3):
        add(e, i, prompt_len=2 + 7 * i, max_tokens=12, max_loops=3)
    both = 0
    while e.sched.has_unfinished() or e.pipeline:
        lanes = e.sched.queues.lanes
        ready = len(lanes[K.PROMPT_RECURRENT, Operation.RECURRENT]) and len(lanes[K.DECODE_RECURRENT, Operation.RECURRENT])
        b = e.step()
        if ready:
            both += 1
            assert b.operation is Operation.RECURRENT and b.work_keys == {K.DECODE_RECURRENT, K.PROMPT_RECURRENT}
    assert both > 0


def test_priority_policy_runs_the_more_important_request_first():
    e = engine_for(policy="priority", max_num_batched_tokens=1, max_num_seqs=4, max_lag=0)
    add(e, "low", prompt_len=1, max_tokens=3, priority=5)
    add(e, "high", prompt_len=1, max_tokens=3, priority=-1)
    e.drain()
    order = [b.items[0].request_id for b in e.batches]
    # synchronous engine: the high-priority request's work is always ready first
    assert order == ["high"] * order.count("high") + ["low"] * order.count("low")


def decode_gaps(e, rid):
    steps = [n for n, b in enumerate(e.batches) if any(i.request_id == rid for i in b.items)]
    return max(b - a for a, b in zip(steps, steps[1:]))


@pytest.mark.parametrize("split", [False, True])
def test_decode_is_not_starved_by_a_stream_of_prompts(split):
    kw = {"split_prefill": True, "prefill_chunk_size": 16} if split else {}
    e = engine_for(blocks=4000, max_num_seqs=64, max_num_batched_tokens=32, **kw)
    add(e, "dec", prompt_len=1, max_tokens=60, max_loops=2)
    for _ in range(6):
        e.step()
    for i in range(40):
        add(e, i, prompt_len=30, max_tokens=1, max_loops=2)
        e.step()
    e.drain()
    # dec's work is passed over at most max_wait_steps (12) + 3 plans x G groups - 1 steps
    # (G = 4: decode and the three PROMPT_ATOMIC lanes; split: decode, PROMPT_PRELUDE,
    # PROMPT_RECURRENT), then runs, and its result may retire one step late (max_lag 1)
    groups = 3 if split else 4
    assert decode_gaps(e, "dec") <= 12 + 3 * groups - 1 + 1 + 1


def test_a_prompt_is_not_starved_by_many_decoding_requests():
    e = engine_for(blocks=4000, max_num_seqs=64, max_num_batched_tokens=64)
    for i in range(30):
        add(e, i, prompt_len=1, max_tokens=50, max_loops=3)
    for _ in range(20):
        e.step()
    add(e, "late", prompt_len=20, max_tokens=1, max_loops=3)
    start = len(e.batches)
    while "late" not in e.finished:
        e.step()
    assert len(e.batches) - start <= 20  # its prelude, loops and coda interleave with decode
