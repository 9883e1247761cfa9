"""The scheduler's bookkeeping invariants, checked by recounting everything (O(n): tests only).

Tests call `check_invariants` after every step; the scheduler never imports this module.
"""

from __future__ import annotations

from loopserve.scheduler.scheduler import Scheduler
from loopserve.scheduler.types import Operation, RequestStatus

S = RequestStatus


def check_invariants(sched: Scheduler) -> None:
    """Slots, lifecycle, pending work, queues, counters and KV agree; nothing left at drain."""
    view = sched.view()
    cfg, reqs, slots = sched.config, view.requests, sched.admission_slots
    assert len(slots) <= cfg.max_num_seqs, f"{len(slots)} slots > max_num_seqs {cfg.max_num_seqs}"
    inflight = {i.request_id: b.batch_id for b in view.inflight for i in b.items}
    assert len(inflight) == sum(len(b.items) for b in view.inflight), "request in two batches"
    for rid in slots:
        st = reqs.get(rid)
        assert st is not None, f"slot held by forgotten request {rid}"
        assert st.status in (S.ACTIVE, S.TRANSFERRING) or (st.status is S.FINISHED and st.in_flight), \
            f"slot held by {rid} in {st.status.value}"
    lane_total = 0
    for (key, op), lane in sched.queues.lanes.items():
        lane_total += len(lane)
        for st in lane:
            assert sched.queues.pending.get(st.request_id) is key and st.phase is op, \
                f"{st.request_id} in lane {key.value}/{op.value} but indexed otherwise"
    assert lane_total == len(sched.queues.pending), "lanes and the pending index disagree"
    waiting = {st.request_id for st in sched.waiting}
    assert len(waiting) == len(sched.waiting), "a request is queued twice in waiting"
    counts = {status: 0 for status in S}
    for rid, st in reqs.items():
        counts[st.status] += 1
        pending, resident = rid in sched.queues.pending, sched.kv.has(rid)
        assert (st.in_flight != 0) == (rid in inflight) and inflight.get(rid, st.in_flight) == st.in_flight, \
            f"{rid}: in_flight {st.in_flight} disagrees with the batches in flight"
        if st.status is S.ACTIVE:
            assert rid in slots, f"ACTIVE {rid} holds no slot"
            assert pending != bool(st.in_flight), f"ACTIVE {rid} must be pending xor in flight"
            assert resident, f"ACTIVE {rid} has no resident KV"
        else:
            assert not pending, f"{rid} is {st.status.value} but has pending work"
        if st.status is S.WAITING:
            assert rid in waiting and rid not in slots and not st.in_flight, f"WAITING {rid} outside the waiting queue"
            assert not (resident and st.offloaded_tokens), f"{rid} both resident and offloaded"
        else:
            assert rid not in waiting, f"{rid} is {st.status.value} but in the waiting queue"
        if st.status is S.RECEIVING:
            assert resident and rid not in slots and (rid in view.landed) == st.kv_landed
        if st.status is S.TRANSFERRING:
            assert resident and rid not in slots and not st.in_flight
        if st.status is S.FINISHED:
            assert st.in_flight, f"FINISHED {rid} not retired though no batch holds it"
    assert counts == view.status_counts, f"status counts drifted: {counts} vs {dict(view.status_counts)}"
    assert set(sched.kv.usage().per_request) <= set(reqs), "blocks held by forgotten requests"
    if view.live_cohort_rows is not None:
        live = sum(len(b.items) for b in view.inflight if b.operation is Operation.RECURRENT)
        live += sum(len(lane) for (_, op), lane in sched.queues.lanes.items() if op is Operation.RECURRENT)
        assert view.live_cohort_rows == live, "no_refill cohort counts drifted"
    sched.kv.check()
    if not reqs:
        assert not slots and not view.inflight, "slots or batches left at drain"
        assert sched.kv.usage().used_blocks == 0, "blocks left at drain"
