"""Scheduler invariants, policies, preemption, speculation, PD states (no torch)."""

import sys

import pytest
from hypothesis import given, settings, strategies as st

from loopserve.kv_cache import KVCacheManager, KVLayout
from loopserve.scheduler import (
    Operation,
    QueueFullError,
    RequestStatus,
    Scheduler,
    SchedulerConfig,
    SchedRequest,
    SpecConfig,
    WorkKey,
)
from tests.scheduler.fake_runner import FakeRunner

POLICY_CONFIGS = {
    "refill": dict(policy="refill"),
    "no_refill": dict(policy="no_refill"),
    "priority": dict(policy="priority"),
    "priority-offload": dict(policy="priority", preemption_mode="offload"),
    "mixed": dict(policy="mixed", split_prefill=True, prefill_chunk_size=4),
    "split": dict(split_prefill=True, prefill_chunk_size=3),
    "speculative": dict(speculative=SpecConfig(3, 1)),
}


def make(blocks=64, bs=2, flat=True, incremental=False, **kw):
    kv = KVCacheManager(KVLayout(bs, blocks, blocks // 2 if flat else 0, flat), incremental=incremental)
    return Scheduler(SchedulerConfig(incremental_kv=incremental, **kw), kv)


def req(i, plen=5, max_tokens=4, prio=0, lo=1, hi=3):
    return SchedRequest(f"r{i}", plen, max_tokens, lo, hi, priority=prio)


def test_scheduler_never_imports_torch():
    import subprocess

    code = "import loopserve.scheduler, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("cfg", list(POLICY_CONFIGS))
def test_every_policy_drains_with_invariants(cfg):
    s = make(blocks=200, max_num_seqs=4, max_num_batched_tokens=16, **POLICY_CONFIGS[cfg])
    for i in range(10):
        s.add_request(req(i, plen=1 + i % 7, prio=i % 3))
    r = FakeRunner(s, seed=1)
    r.drain()
    assert all(len({it.request_id for it in b.items}) == len(b.items) for b in r.batches)
    assert all(b.num_rows <= 16 or len(b.items) == 1 for b in r.batches)


def test_batches_are_single_operation_and_remember_work_keys():
    s = make(blocks=200, max_num_seqs=8)
    for i in range(5):
        s.add_request(req(i))
    r = FakeRunner(s)
    r.drain()
    from loopserve.scheduler.types import FIXED_OPERATION

    for b in r.batches:
        for it in b.items:
            if it.work_key in FIXED_OPERATION:
                assert FIXED_OPERATION[it.work_key] is b.operation


def test_mixed_policy_forms_mixed_prelude_and_recurrent_batches():
    s = make(blocks=400, max_num_seqs=8, max_num_batched_tokens=32, policy="mixed",
             split_prefill=True, prefill_chunk_size=4)
    s.add_request(req(0, plen=2, max_tokens=30, hi=3))
    r = FakeRunner(s, seed=2, finish_p=0.0)
    for _ in range(12):  # r0 reaches decode
        r.step()
    s.add_request(req(1, plen=40, max_tokens=2, hi=3))
    kinds = set()
    for _ in range(200):
        r.step()
        for b in r.batches[-1:]:
            kinds.add((b.operation, frozenset(it.work_key for it in b.items)))
        if not s.has_unfinished():
            break
    assert (Operation.PRELUDE, frozenset({WorkKey.DECODE_PRELUDE, WorkKey.PROMPT_PRELUDE})) in kinds
    assert (Operation.RECURRENT, frozenset({WorkKey.DECODE_RECURRENT, WorkKey.PROMPT_RECURRENT})) in kinds


def test_refill_mixes_loop_depths_in_one_recurrent_batch():
    s = make(blocks=400, max_num_seqs=8, max_num_batched_tokens=64)
    for i in range(6):
        s.add_request(req(i, plen=1, max_tokens=20, hi=4))
    r = FakeRunner(s, seed=3, finish_p=0.0)
    depth_sets = []
    while s.has_unfinished() or r.inflight:
        r.step()
        b = r.batches[-1]
        if b.operation is Operation.RECURRENT:
            depth_sets.append({it.depth for it in b.items})
    assert any(len(d) > 1 for d in depth_sets), "refill should mix depths"


def test_no_refill_runs_fixed_cohorts():
    s = make(blocks=400, max_num_seqs=8, max_num_batched_tokens=64, policy="no_refill")
    for i in range(6):
        s.add_request(req(i, plen=1, max_tokens=20, hi=4))
    r = FakeRunner(s, seed=3, finish_p=0.0)
    while s.has_unfinished() or r.inflight:
        r.step()
        b = r.batches[-1]
        decode = [it for it in b.items if it.work_key is WorkKey.DECODE_RECURRENT]
        if b.operation is Operation.RECURRENT and decode:
            assert len({it.depth for it in decode}) == 1, "a cohort loops in lockstep"


def test_decode_is_not_starved_by_a_stream_of_prompts():
    s = make(blocks=2000, max_num_seqs=64, max_num_batched_tokens=64)
    s.add_request(req(0, plen=1, max_tokens=50, hi=2))
    r = FakeRunner(s, finish_p=0.0)
    for _ in range(8):
        r.step()
    gap, worst = 0, 0
    for i in range(1, 40):
        s.add_request(req(i, plen=30, max_tokens=1, hi=2))
        r.step()
        r.step()
        is_decode = any(it.request_id == "r0" for it in r.batches[-1].items + r.batches[-2].items)
        gap = 0 if is_decode else gap + 2
        worst = max(worst, gap)
    assert worst <= 6


def test_fixed_regression_split_priority_preemption_drains():
    """split prefill + priority + preemption, 40 blocks of 2, incremental, 4 seqs, budget 6, chunk 4."""
    s = make(blocks=40, bs=2, incremental=True, max_num_seqs=4, max_num_batched_tokens=6,
             prefill_chunk_size=4, split_prefill=True, policy="priority", preemption_mode="offload")
    r = FakeRunner(s, seed=5, finish_p=0.02)
    for i in range(12):
        s.add_request(req(i, plen=3 + (i * 5) % 9, max_tokens=6, prio=-i, hi=2))
        r.step()
        s.assert_invariants()
    r.drain()
    assert s.num_preemptions > 0
    assert s.kv.usage().used_blocks == 0


def test_priority_preemption_keeps_kv_and_resumes_through_activation():
    s = make(blocks=400, max_num_seqs=1, policy="priority", preemption_mode="keep")
    s.add_request(req(0, prio=5, max_tokens=20))
    r = FakeRunner(s, finish_p=0.0)
    for _ in range(6):
        r.step()
    r.drain_one = None
    s.add_request(req(1, prio=0, max_tokens=2))
    r.step()
    r0 = s.get_request("r0")
    assert r0.status is RequestStatus.WAITING and s.kv.has("r0") and r0.snapshot is not None
    snap = r0.snapshot
    r.drain()
    assert s.num_preemptions >= 1
    assert snap is not None


def test_waiting_victim_keeps_queue_position_and_snapshot():
    s = make(blocks=30, bs=2, incremental=True, max_num_seqs=1, policy="priority", preemption_mode="keep")
    r = FakeRunner(s, finish_p=0.0)
    s.add_request(req(0, prio=5, plen=4, max_tokens=10, hi=2))
    s.add_request(req(9, prio=6, plen=2, max_tokens=2, hi=2))
    for _ in range(5):
        r.step()
    s.add_request(req(1, prio=0, plen=4, max_tokens=20, hi=2))
    order_before = None
    for _ in range(60):
        r.step()
        r0 = s.get_request("r0")
        if r0 and r0.status is RequestStatus.WAITING:
            if order_before is None:
                order_before, snap = list(s.waiting).index("r0"), r0.snapshot
            else:
                assert r0.snapshot is snap  # reused, not retaken
    r.drain()


def test_abort_in_flight_frees_after_retire():
    s = make(blocks=200, max_num_seqs=4)
    s.add_request(req(0))
    out = s.schedule()
    assert out.batch is not None
    used = s.kv.usage().used_blocks
    assert s.abort("r0")
    s.assert_invariants()
    assert s.kv.usage().used_blocks == used and "r0" in s.admission_slots  # held until retire
    s.update(out.batch, FakeRunner(s).result(out.batch))
    s.assert_invariants()
    assert s.kv.usage().used_blocks == 0 and not s.admission_slots
    assert not s.abort("r0") and not s.abort("unknown")


def test_pd_states_prefill_and_decode():
    p = make(blocks=200, role="prefill")
    p.add_request(req(0, max_tokens=5))
    r = FakeRunner(p, finish_p=0.0)
    seen = set()
    while p.get_request("r0").status is not RequestStatus.TRANSFERRING:
        r.step()
        seen.add(p.get_request("r0").status)
    assert RequestStatus.ACTIVE in seen and "r0" not in p.admission_slots and p.kv.has("r0")
    p.assert_invariants()
    p.transfer_done("r0")
    assert p.kv.usage().used_blocks == 0 and not p.has_unfinished()

    d = make(blocks=200, role="decode", max_num_seqs=1)
    assert d.add_receiving(req(0, max_tokens=5), 5)
    assert d.get_request("r0").status is RequestStatus.RECEIVING and not d.admission_slots
    assert d.schedule().batch is None  # KV not landed: no slot, no work
    d.kv_received("r0")
    out = d.schedule()
    assert d.get_request("r0").status is RequestStatus.ACTIVE
    assert out.batch.items[0].work_key is WorkKey.DECODE_PRELUDE and out.batch.items[0].positions == (5,)
    d.update(out.batch, FakeRunner(d).result(out.batch))
    FakeRunner(d).drain()


def test_speculative_round_shape():
    s = make(blocks=400, max_num_seqs=2, speculative=SpecConfig(3, 1))
    s.add_request(req(0, plen=2, max_tokens=10, hi=3))
    r = FakeRunner(s, finish_p=0.0)
    r.drain()
    spec = [(b.operation, it) for b in r.batches for it in b.items if it.work_key is WorkKey.SPECULATIVE]
    assert any(it.verify and len(it.logits_positions) == 3 for _, it in spec)
    assert any(op is Operation.RECURRENT and it.depth == 2 and not it.draft for op, it in spec)


@pytest.mark.parametrize("kw,field", [
    (dict(max_num_seqs=0), "max_num_seqs"),
    (dict(split_prefill=True, prefill_chunk_size=64, max_num_batched_tokens=32), "prefill_chunk_size"),
    (dict(policy="mixed"), "split_prefill"),
    (dict(policy="mixed", split_prefill=True, prefill_chunk_size=4, speculative=SpecConfig()), "speculative"),
    (dict(policy="fifo"), "policy"),
])
def test_bad_configs_name_the_fields(kw, field):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**kw)


def test_backpressure():
    s = make(max_waiting=2, max_num_seqs=1)
    s.add_request(req(0))
    s.add_request(req(1))
    with pytest.raises(QueueFullError):
        s.add_request(req(2))


op_strategy = st.lists(
    st.tuples(st.sampled_from(["add", "step", "step", "step", "abort", "handoff", "land"]),
              st.integers(0, 30), st.integers(1, 9), st.integers(-2, 2)),
    min_size=5, max_size=60)


@pytest.mark.parametrize("cfg", list(POLICY_CONFIGS) + ["incremental"])
@settings(max_examples=25, deadline=None)
@given(ops=op_strategy, inflight=st.integers(1, 2), seed=st.integers(0, 100))
def test_property_invariants_and_no_livelock(cfg, ops, inflight, seed):
    kw = dict(POLICY_CONFIGS.get(cfg, dict(policy="priority", preemption_mode="offload")))
    incremental = cfg == "incremental" or cfg == "priority-offload"
    role = "decode" if seed % 3 == 0 and "speculative" not in cfg else "colocated"
    s = make(blocks=60, bs=2, incremental=incremental, max_num_seqs=3, max_num_batched_tokens=12,
             role=role, **kw)
    r = FakeRunner(s, seed=seed)
    n = 0
    for op, a, b, prio in ops:
        if op == "add":
            s.add_request(req(n, plen=b, max_tokens=1 + a % 5, prio=prio, hi=1 + a % 3))
            n += 1
        elif op == "step":
            r.step(inflight)
        elif op == "abort":
            s.abort(f"r{a % max(n, 1)}")
        elif op == "handoff" and role == "decode":
            if s.add_receiving(req(100 + n, plen=b, max_tokens=2 + a % 3, hi=2), b):
                n += 1
        elif op == "land":
            for rid in list(s.receiving):
                s.kv_received(rid)
        s.assert_invariants()
    for rid in list(s.receiving):
        s.kv_received(rid)
    r.drain(max_inflight=inflight)
    assert s.kv.usage().used_blocks == 0 and not s.admission_slots
