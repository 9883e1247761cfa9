"""Lifecycle: abort at every status and in flight, PD states, async batches, bad results."""

import subprocess
import sys

import pytest

from loopserve.scheduler import (
    BatchResult,
    ItemResult,
    Operation,
    RequestStatus,
    SchedRequest,
    WorkKey,
)
from loopserve.scheduler.invariants import check_invariants
from tests.scheduler.helpers import add, engine_for

S = RequestStatus


def test_scheduler_never_imports_torch():
    code = "import loopserve.scheduler, sys; assert 'torch' not in sys.modules, 'torch imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_abort_in_flight_frees_only_when_the_batch_retires():
    e = engine_for(max_lag=0)
    add(e, 0)
    out = e.sched.schedule()
    used = e.sched.kv.usage().used_blocks
    assert e.sched.abort("r0")
    st = e.sched.get_request("r0")
    assert st.status is S.FINISHED and "r0" in e.sched.admission_slots  # keeps its slot
    assert e.sched.kv.usage().used_blocks == used
    check_invariants(e.sched)
    assert not e.sched.abort("r0") and not e.sched.abort("nope")
    events = e.sched.update(out.batch, BatchResult({}))  # no result needed for an aborted item
    assert events.finished == [] and e.sched.get_request("r0") is None
    assert e.sched.kv.usage().used_blocks == 0 and not e.sched.admission_slots
    assert e.sched.schedule().freed == ("r0",)
    check_invariants(e.sched)


def test_stop_ends_a_request_as_finished_in_flight_or_queued():
    """stop(): the engine saw a stop token after the request's next work was scheduled."""
    e = engine_for(max_lag=0)
    add(e, 0, max_tokens=8)
    add(e, 1, max_tokens=8)
    out = e.sched.schedule()  # r0 (and r1) in flight
    assert {i.request_id for i in out.batch.items} == {"r0", "r1"}
    assert e.sched.stop("r0")
    assert e.sched.get_request("r0").status is S.FINISHED and "r0" in e.sched.admission_slots
    assert not e.sched.stop("r0") and not e.sched.abort("r0") and not e.sched.stop("nope")
    e.sched.update(out.batch, BatchResult({"r1": ItemResult()}))
    assert e.sched.get_request("r0") is None and "r0" not in e.sched.admission_slots
    assert e.sched.get_request("r1").status is S.ACTIVE and e.sched.stop("r1")  # queued, not in flight
    assert e.sched.get_request("r1") is None and not e.sched.queues.pending
    assert (e.sched.num_finished, e.sched.num_aborted) == (2, 0)
    assert e.sched.kv.usage().used_blocks == 0
    check_invariants(e.sched)


def reach(e, rid, pred, limit=300):
    for _ in range(limit):
        st = e.sched.get_request(rid)
        if st is not None and pred(st):
            return st
        e.step()
    raise AssertionError(f"{rid} never reached the state")


def waiting_resident(e):
    add(e, "victim", max_tokens=8, max_loops=2, priority=5)
    reach(e, "victim", lambda st: st.n_out >= 2 and not st.in_flight)
    add(e, "boss", max_tokens=8, max_loops=2, priority=0)
    e.step()
    return reach(e, "victim", lambda st: st.status is S.WAITING)


ABORT_AT = {
    "waiting": lambda e: e.sched.get_request(add(e, "victim")),
    "active-pending": lambda e: (add(e, "victim"), reach(e, "victim", lambda st: st.n_out >= 1 and not st.in_flight))[1],
    "active-in-flight": lambda e: (add(e, "victim"), reach(e, "victim", lambda st: st.in_flight != 0))[1],
    "waiting-resident": waiting_resident,
    "waiting-offloaded": lambda e: (waiting_resident(e),
                                    reach(e, "victim", lambda st: st.offloaded_tokens > 0))[1],
}


@pytest.mark.parametrize("where", list(ABORT_AT))
def test_abort_at_every_status_drains_clean(where):
    kw = dict(policy="priority", max_num_seqs=1, max_lag=1)
    if where == "waiting-offloaded":
        kw.update(incremental=True, blocks=16)
    e = engine_for(seed=2, **kw)
    st = ABORT_AT[where](e)
    resident, pending = e.sched.kv.has("victim"), "victim" in e.sched.queues
    assert (st.status, resident, pending, bool(st.in_flight)) == {
        "waiting": (S.WAITING, False, False, False),
        "active-pending": (S.ACTIVE, True, True, False),
        "active-in-flight": (S.ACTIVE, True, False, True),
        "waiting-resident": (S.WAITING, True, False, False),
        "waiting-offloaded": (S.WAITING, False, False, False),
    }[where]
    assert e.abort("victim")
    assert st.status is S.FINISHED
    check_invariants(e.sched)
    e.drain()
    assert "victim" not in e.finished
    assert e.sched.kv.usage().used_blocks == 0


def test_async_schedule_skips_requests_in_flight_and_batches_are_checked():
    e = engine_for()
    add(e, 0)
    add(e, 1, prompt_len=2)
    first = e.sched.schedule()
    second = e.sched.schedule()  # both requests are in flight: nothing to run
    assert first.batch is not None and second.batch is None
    res = e.execute(first.batch)
    with pytest.raises(ValueError, match="no result"):
        e.sched.update(first.batch, BatchResult({"r0": res.items["r0"]}))
    e.sched.update(first.batch, res)
    with pytest.raises(ValueError, match="not in flight"):
        e.sched.update(first.batch, res)
    check_invariants(e.sched)


def test_results_contradicting_the_item_are_rejected_before_any_change():
    e = engine_for(max_lag=0)
    add(e, 0, prompt_len=3, min_loops=2)
    e.step()  # prelude
    out = e.sched.schedule()  # loop 1
    assert out.batch.operation is Operation.RECURRENT
    with pytest.raises(ValueError, match="min_loops"):
        e.sched.update(out.batch, BatchResult({"r0": ItemResult(exited=(0,))}))
    with pytest.raises(ValueError, match="not among"):
        e.sched.update(out.batch, BatchResult({"r0": ItemResult(exited=(9,))}))
    check_invariants(e.sched)  # still in flight, untouched
    e.sched.update(out.batch, BatchResult({"r0": ItemResult()}))


def test_activation_is_refused_outside_waiting_or_landed():
    e = engine_for()
    add(e, 0)
    e.sched.schedule()
    with pytest.raises(RuntimeError, match="activate_request"):
        e.sched.activate_request("r0")  # already ACTIVE (and in flight)


def pd_pair(seed=0, **kw):
    p = engine_for(seed=seed, role="prefill", **kw)
    d = engine_for(seed=seed + 1, role="decode", **kw)
    return p, d


def hand_over(p, d, rid, max_tokens):
    t = p.tracks[rid]
    req = SchedRequest(rid, t.prompt_len, max_tokens, t.min_loops, t.max_loops)
    if not d.sched.add_receiving(req, t.prompt_len):
        return False
    d.track(rid, t.prompt_len, max_tokens, t.min_loops, t.max_loops, n_out=1)
    d.read_kv_from(p, rid)
    return True


def test_pd_prefill_transfers_and_decode_continues_from_the_first_token():
    p, d = pd_pair(max_num_seqs=1)
    add(p, "x", prompt_len=5, max_tokens=4)
    add(p, "y", prompt_len=3, max_tokens=1)  # finished by its first token: no transfer
    seen = set()
    while "x" not in p.transferring:
        p.step()
        seen.add(p.sched.get_request("x").status)
    st = p.sched.get_request("x")
    assert S.ACTIVE in seen and st.status is S.TRANSFERRING
    assert "x" not in p.sched.admission_slots and p.sched.kv.has("x")  # slot freed, blocks held
    assert p.sched.stats().num_transferring == 1
    p.drain()
    assert p.finished == {"y": 1} and p.transferring == ["x"]
    assert hand_over(p, d, "x", 4)
    rx = d.sched.get_request("x")
    assert rx.status is S.RECEIVING and not d.sched.admission_slots
    assert d.sched.schedule().batch is None  # KV not landed: no slot, no work
    with pytest.raises(ValueError, match="RECEIVING"):
        p.sched.kv_received("x")
    d.sched.kv_received("x")
    assert p.sched.transfer_done("x") and not p.sched.has_unfinished()
    assert p.sched.kv.usage().used_blocks == 0
    b = d.step()
    assert rx.status is S.ACTIVE and "x" in d.sched.admission_slots
    assert b.items[0].work_key is WorkKey.DECODE_PRELUDE and b.items[0].positions == (5,)
    d.drain()
    assert d.finished == {"x": 4}


def test_pd_decode_side_waits_for_blocks_and_slots():
    d = engine_for(role="decode", blocks=12, max_num_seqs=1)
    big = SchedRequest("big", 8, 4, 1, 2)  # 12 positions x 2 planes = 12 blocks of 2
    assert d.sched.add_receiving(big, 8)
    assert not d.sched.add_receiving(SchedRequest("late", 2, 2, 1, 2), 2)  # blocks short now
    assert d.sched.get_request("late") is None and d.sched.kv.usage().looped.used == 12
    d.track("big", 8, 4, 1, 2, n_out=1)
    d.zero_new_blocks()
    for q in range(8):  # the prompt's KV as a prefill engine would have written it
        t = d.kv.block_table("big")
        for plane in t.depth:
            d.write(plane, d.looped, "big", q)
        d.write(t.flat, d.flat, "big", q)
    d.sched.kv_received("big")
    d.drain()
    assert d.finished == {"big": 4}
    with pytest.raises(ValueError, match="num_computed_tokens"):
        d.sched.add_receiving(SchedRequest("bad", 4, 2, 1, 2), 9)


def test_pd_calls_in_the_wrong_state_name_the_state():
    c = engine_for()
    with pytest.raises(ValueError, match="role='decode'"):
        c.sched.add_receiving(SchedRequest("a", 2, 2, 1, 1), 2)
    add(c, "a")
    with pytest.raises(ValueError, match="TRANSFERRING"):
        c.sched.transfer_done("a")
    assert not c.sched.transfer_done("nope") and not c.sched.kv_received("nope")


def test_abort_receiving_and_transferring():
    p, d = pd_pair()
    add(p, "x", prompt_len=4, max_tokens=3)
    while "x" not in p.transferring:
        p.step()
    assert hand_over(p, d, "x", 3)
    assert p.abort("x") and d.abort("x")
    for e in (p, d):
        check_invariants(e.sched)
        assert not e.sched.has_unfinished() and e.sched.kv.usage().used_blocks == 0


def test_stats_track_statuses():
    e = engine_for(max_num_seqs=1, policy="priority")
    add(e, 0, max_tokens=8, priority=3)
    add(e, 1, max_tokens=8, priority=3)
    e.step()
    s = e.sched.stats()
    assert (s.num_waiting, s.num_running, s.num_slots) == (1, 1, 1)
    add(e, 2, max_tokens=2, priority=0)
    e.drain()
    s = e.sched.stats()
    assert s.num_finished == 3 and s.num_preemptions >= 1 and s.num_waiting == 0


def test_admission_lets_at_most_8_bypass_a_blocked_request_and_scans_64():
    e = engine_for(blocks=40, max_num_seqs=100, max_waiting=200)
    add(e, "big", prompt_len=30, max_tokens=8, max_loops=1)  # 38 tokens: 19 of the 40 blocks
    add(e, "hog", prompt_len=34, max_tokens=10, max_loops=1)  # 22 blocks: blocked behind big
    e.sched.schedule()
    assert e.sched.get_request("big").status is RequestStatus.ACTIVE
    for i in range(20):
        add(e, i, prompt_len=1, max_tokens=1, max_loops=1)  # 1 block each
    e.sched.schedule()
    assert e.sched.get_request("hog").status is RequestStatus.WAITING  # blocked ...
    admitted = [f"r{i}" for i in range(20) if e.sched.get_request(f"r{i}").status is RequestStatus.ACTIVE]
    assert admitted == [f"r{i}" for i in range(8)]  # ... and only 8 may pass it per step

    e = engine_for(blocks=40, max_num_seqs=100, max_waiting=200)
    add(e, "hog", prompt_len=30, max_tokens=8, max_loops=1)
    e.sched.schedule()
    for i in range(64):
        add(e, f"big{i}", prompt_len=40, max_tokens=8, max_loops=1)  # 24 blocks: none fits beside hog
    add(e, "small", prompt_len=1, max_tokens=1, max_loops=1)
    e.sched.schedule()
    assert e.sched.get_request("small").status is RequestStatus.WAITING  # 65th: not scanned


def test_status_changes_name_each_request_whose_status_was_set_since_the_last_take():
    e = engine_for(max_lag=0)
    with pytest.raises(RuntimeError):
        e.sched.take_status_changes()
    e.sched.record_status_changes()
    add(e, 0)
    add(e, 1)
    assert e.sched.take_status_changes() == ["r0", "r1"]  # new: WAITING
    assert e.sched.take_status_changes() == []
    e.sched.schedule()
    active = [rid for rid in ("r0", "r1") if e.sched.get_request(rid).status is S.ACTIVE]
    assert active and e.sched.take_status_changes() == active
    assert e.sched.abort("r0")
    assert e.sched.take_status_changes() == ["r0"]  # FINISHED
