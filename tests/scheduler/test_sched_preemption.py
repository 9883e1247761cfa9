"""Preemption by priority and by capacity: keep vs offload, WAITING victims, resume, regression."""

import pytest

from loopserve.scheduler import RequestStatus
from loopserve.scheduler.invariants import check_invariants
from loopserve.scheduler.preemption import plan_victims
from loopserve.scheduler.request import RequestState, SchedRequest
from tests.scheduler.helpers import add, engine_for

S = RequestStatus


def progress(st):
    return (st.unit, st.phase, st.done, st.depth, st.live, st.rows, st.n_out)


def run_until(e, cond, limit=500):
    for _ in range(limit):
        if cond():
            return
        e.step()
        check_invariants(e.sched)
    raise AssertionError("condition never met")


@pytest.mark.parametrize("mode", ["keep", "offload"])
def test_priority_victim_yields_its_slot_and_resumes_where_it_stopped(mode):
    e = engine_for(policy="priority", preemption_mode=mode, max_num_seqs=1, max_lag=0)
    add(e, "low", prompt_len=4, max_tokens=12, min_loops=2, max_loops=3, priority=5)
    low = e.sched.get_request("low")
    run_until(e, lambda: low.n_out >= 3 and low.phase.value == "RECURRENT")
    before = progress(low)
    add(e, "high", prompt_len=3, max_tokens=3, priority=0)
    e.step()
    assert e.last.preempted == ("low",) and low.status is S.WAITING
    assert "low" not in e.sched.admission_slots and e.sched.get_request("high").status is S.ACTIVE
    assert e.sched.kv.has("low") == (mode == "keep")
    assert e.swaps == ([] if mode == "keep" else [("out", "low")])
    assert progress(low) == before  # nothing of its pending work was lost or redone
    e.drain()
    assert e.swaps == ([] if mode == "keep" else [("out", "low"), ("in", "low")])
    assert set(e.finished) == {"low", "high"} and e.sched.num_preemptions == 1
    first_after = next(n for n, b in enumerate(e.batches) if any(i.request_id == "high" for i in b.items))
    resumed = next(i for b in e.batches[first_after:] for i in b.items if i.request_id == "low")
    assert resumed.depth == before[3] + 1  # continued with the loop it had pending


def test_equal_priority_never_preempts():
    e = engine_for(policy="priority", max_num_seqs=1, max_lag=0)
    add(e, "a", max_tokens=6, priority=1)
    e.step()
    add(e, "b", max_tokens=2, priority=1)
    e.drain()
    assert e.sched.num_preemptions == 0
    assert max(n for n, b in enumerate(e.batches) if b.items[0].request_id == "a") < \
        min(n for n, b in enumerate(e.batches) if b.items[0].request_id == "b")


def test_a_blocked_request_never_evicts_equal_priority_bypassers():
    e = engine_for(policy="priority", blocks=20, max_num_seqs=4)
    add(e, "c", prompt_len=2, max_tokens=10, max_loops=1, priority=1)  # 6 blocks
    add(e, "a", prompt_len=2, max_tokens=30, max_loops=1, priority=1)  # 16: blocked behind c
    add(e, "b", prompt_len=2, max_tokens=14, max_loops=1, priority=1)  # 8: bypasses a
    e.step()
    assert {st.request_id for st in e.sched.waiting} == {"a"} and e.sched.kv.has("b")
    e.drain()
    assert e.sched.num_preemptions == 0 and set(e.finished) == {"a", "b", "c"}
    assert e.finished == {"c": 10, "b": 14, "a": 30}


def test_waiting_victim_with_resident_kv_is_offloaded_in_place_without_a_new_snapshot():
    # keep-mode priority victim `low`, then `high`'s KV growth takes low's blocks (capacity)
    e = engine_for(policy="priority", preemption_mode="keep", incremental=True, blocks=16,
                   max_num_seqs=1, max_lag=0)
    add(e, "low", prompt_len=6, max_tokens=8, min_loops=2, max_loops=2, priority=5)
    low = e.sched.get_request("low")
    run_until(e, lambda: low.n_out >= 4)
    add(e, "mid", prompt_len=2, max_tokens=2, min_loops=2, max_loops=2, priority=5)
    add(e, "high", prompt_len=2, max_tokens=12, min_loops=2, max_loops=2, priority=0)
    e.step()
    assert low.status is S.WAITING and e.sched.kv.has("low") and e.swaps == []
    order = [st.request_id for st in e.sched.waiting]
    assert order == ["low", "mid"]  # the preempted request resumes first
    snapshot = progress(low)
    run_until(e, lambda: not e.sched.kv.has("low"))
    assert e.swaps == [("out", "low")] and low.status is S.WAITING
    assert [st.request_id for st in e.sched.waiting] == order  # kept its queue position
    assert progress(low) == snapshot and low.num_preemptions == 1  # snapshot reused, not retaken
    e.drain()
    assert set(e.finished) == {"low", "mid", "high"}
    assert e.swaps == [("out", "low"), ("in", "low")]


def test_capacity_preemption_offloads_the_latest_arrival_and_everything_drains():
    e = engine_for(seed=4, incremental=True, blocks=24, max_num_seqs=6, max_num_batched_tokens=16,
                   finish_p=0.0)
    for i in range(6):
        add(e, i, prompt_len=3, max_tokens=10, min_loops=1, max_loops=2)
    e.drain()
    assert e.sched.num_preemptions > 0 and set(e.finished) == set(e.tracks)
    outs = [rid for kind, rid in e.swaps if kind == "out"]
    assert "r0" not in outs  # the first arrival ranks above every victim
    assert sorted(outs) == sorted(rid for kind, rid in e.swaps if kind == "in")


@pytest.mark.parametrize("mode", ["keep", "offload"])
@pytest.mark.parametrize("seed", range(4))
def test_regression_split_priority_preemption_incremental_drains(mode, seed):
    """Fixed case: split prefill + priority + preemption, 40 blocks of size 2, incremental,
    max_num_seqs=4, max_num_batched_tokens=6, prefill_chunk_size=4: it must drain."""
    e = engine_for(seed=seed, blocks=40, block_size=2, incremental=True, max_num_seqs=4,
                   max_num_batched_tokens=6, split_prefill=True, prefill_chunk_size=4,
                   policy="priority", preemption_mode=mode, finish_p=0.02)
    for i in range(12):
        add(e, i, prompt_len=3 + (i * 5) % 9, max_tokens=6, max_loops=2, priority=-i)
        e.step()
        check_invariants(e.sched)
    e.drain()
    assert e.sched.num_preemptions > 0
    assert set(e.finished) == set(e.tracks) and e.sched.kv.usage().used_blocks == 0


def state(rid, prio, seq, status, blocks):
    st = RequestState(SchedRequest(rid, 4, 4, 1, 2, priority=prio), seq, prio, status)
    return st, blocks


def test_victim_plan_is_a_dry_run():
    a, ab = state("a", 9, 3, S.ACTIVE, (4, 2))
    w, wb = state("w", 8, 2, S.WAITING, (2, 1))
    blocks = {"a": ab, "w": wb}
    of = lambda st: blocks[st.request_id]  # noqa: E731
    # not enough even with everyone: nobody is chosen
    assert plan_victims([a, w], of, need_slot=False, short=(7, 0), slot_victim_offloads=False) is None
    # blocks only: worst first, stop as soon as covered
    p = plan_victims([a, w], of, need_slot=False, short=(3, 0), slot_victim_offloads=False)
    assert p.slot is None and p.offload == [a]
    # a slot: only an ACTIVE request has one; keep mode leaves its KV
    p = plan_victims([w, a], of, need_slot=True, short=(0, 0), slot_victim_offloads=False)
    assert p.slot is a and p.offload == []
    p = plan_victims([w], of, need_slot=True, short=(0, 0), slot_victim_offloads=False)
    assert p is None
    # offload mode: the slot victim's blocks count
    p = plan_victims([a, w], of, need_slot=True, short=(4, 2), slot_victim_offloads=True)
    assert p.slot is a and p.offload == [a]
