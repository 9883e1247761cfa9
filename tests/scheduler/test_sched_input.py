"""Bad configs and requests fail early with errors naming the field; queue building blocks."""

import pytest

from loopserve.kv_cache import KVCacheManager, KVCapacityError, KVLayout
from loopserve.scheduler import (
    BatchItem,
    DuplicateSelectionError,
    Operation,
    RequestStatus,
    ScheduledBatch,
    Scheduler,
    SchedulerConfig,
    SchedRequest,
    SpeculativeConfig,
    WorkKey,
)
from loopserve.protocol.status import QueueFullError
from loopserve.scheduler.invariants import check_invariants
from loopserve.scheduler.policy import POLICIES
from loopserve.scheduler.queues import RankedFifo, WorkQueues
from loopserve.scheduler.request import RequestState
from tests.scheduler.helpers import make_scheduler


@pytest.mark.parametrize("kw,fields", [
    (dict(max_num_seqs=0), ["max_num_seqs", "1", "0"]),
    (dict(max_num_batched_tokens=0), ["max_num_batched_tokens"]),
    (dict(split_prefill=True, prefill_chunk_size=64, max_num_batched_tokens=32),
     ["prefill_chunk_size (64)", "max_num_batched_tokens (32)"]),
    (dict(prefill_chunk_size=8), ["prefill_chunk_size", "split_prefill"]),
    (dict(policy="mixed"), ["policy='mixed'", "split_prefill"]),
    (dict(policy="mixed", split_prefill=True, speculative=SpeculativeConfig()), ["speculative", "mixed"]),
    (dict(policy="fifo"), ["policy", "refill", "fifo"]),
    (dict(speculative=SpeculativeConfig(num_draft_tokens=8), max_num_batched_tokens=4),
     ["speculative.num_draft_tokens (8)", "max_num_batched_tokens (4)"]),
    (dict(preemption_mode="swap"), ["preemption_mode"]),
    (dict(role="router"), ["role"]),
    (dict(max_waiting=0), ["max_waiting"]),
    (dict(max_wait_steps=0), ["max_wait_steps", "1", "0"]),
])
def test_bad_configs_fail_at_construction_naming_the_fields(kw, fields):
    with pytest.raises(ValueError) as e:
        SchedulerConfig(**kw)
    for f in fields:
        assert f in str(e.value)


def test_unknown_policy_names_the_field_and_every_registered_policy():
    with pytest.raises(ValueError) as e:
        SchedulerConfig(policy="fifo")
    msg = str(e.value)
    assert "policy" in msg and "'fifo'" in msg and all(name in msg for name in POLICIES), msg


def test_spec_config_and_defaults():
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SpeculativeConfig(num_draft_tokens=0)
    with pytest.raises(ValueError, match="draft_loops"):
        SpeculativeConfig(draft_loops=0)
    with pytest.raises(ValueError, match=r"num_draft_tokens\n.*less than or equal to 16"):
        SpeculativeConfig(num_draft_tokens=17)
    assert SchedulerConfig(split_prefill=True, max_num_batched_tokens=100).prefill_chunk_size == 100
    assert SchedulerConfig(split_prefill=True).prefill_chunk_size == 256


def test_scheduler_and_kv_manager_must_agree_on_incremental():
    kv = KVCacheManager(KVLayout(4, 16), incremental=True)
    with pytest.raises(ValueError, match="incremental_kv"):
        Scheduler(SchedulerConfig(), kv)


@pytest.mark.parametrize("kw,field", [
    (dict(request_id=""), "request_id"),
    (dict(prompt_len=0), "prompt_len"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_loops=0), "min_loops"),
    (dict(min_loops=3, max_loops=2), "max_loops"),
    (dict(priority=1.5), "priority"),
    (dict(num_planes=3), "num_planes"),
    (dict(num_planes=0), "num_planes"),
])
def test_bad_requests_name_the_field(kw, field):
    base = dict(request_id="a", prompt_len=2, max_tokens=2, min_loops=1, max_loops=2)
    with pytest.raises(ValueError, match=field):
        SchedRequest(**{**base, **kw})


def test_add_request_rejects_duplicates_impossible_requests_and_overflow():
    s = make_scheduler(blocks=8, max_waiting=2)
    s.add_request(SchedRequest("a", 2, 2, 1, 2))
    with pytest.raises(ValueError, match="already scheduled"):
        s.add_request(SchedRequest("a", 2, 2, 1, 2))
    with pytest.raises(KVCapacityError, match="'huge' needs 20 looped"):
        s.add_request(SchedRequest("huge", 10, 10, 1, 2))
    s.add_request(SchedRequest("b", 2, 2, 1, 2))
    with pytest.raises(QueueFullError, match="max_waiting=2"):
        s.add_request(SchedRequest("c", 2, 2, 1, 2))
    assert s.stats().num_waiting == 2
    check_invariants(s)


def st(rid, rank=0):
    return RequestState(SchedRequest(rid, 1, 1, 1, 1), 0, rank)


def test_ranked_fifo_orders_by_rank_then_insertion():
    q = RankedFifo()
    for rid, rank in [("a", 2), ("b", 0), ("c", 2), ("d", 0), ("e", 1)]:
        q.add(st(rid, rank), rank)
    assert [x.request_id for x in q] == ["b", "d", "e", "a", "c"]
    q.remove("d", 0)
    q.remove("b", 0)
    assert q.head().request_id == "e" and q.head_rank() == 1 and len(q) == 3
    assert [x.request_id for x in q.snapshot()] == ["e", "a", "c"]


def test_work_queues_keep_one_pending_key_per_request():
    wq = WorkQueues()
    a, b = st("a"), st("b")
    a.phase = b.phase = Operation.PRELUDE
    wq.push([a, b], [WorkKey.DECODE_PRELUDE, WorkKey.PROMPT_PRELUDE])
    with pytest.raises(DuplicateSelectionError, match="already has pending work DECODE_PRELUDE"):
        wq.push([a], [WorkKey.DECODE_PRELUDE])
    with pytest.raises(DuplicateSelectionError, match="selected without pending"):
        wq.select((WorkKey.DECODE_PRELUDE, Operation.PRELUDE), [b])  # b is queued elsewhere
    assert wq.take(a) is WorkKey.DECODE_PRELUDE
    with pytest.raises(DuplicateSelectionError):
        wq.take(a)
    assert len(wq) == 1 and "b" in wq


def test_batches_are_single_operation_with_each_request_once():
    item = BatchItem("a", WorkKey.DECODE_PRELUDE, (3,))
    with pytest.raises(ValueError, match="twice"):
        ScheduledBatch(1, Operation.PRELUDE, (item, item))
    with pytest.raises(ValueError, match="DECODE_PRELUDE"):
        ScheduledBatch(1, Operation.CODA, (item,))
    with pytest.raises(ValueError, match="no items"):
        ScheduledBatch(1, Operation.CODA, ())
    b = ScheduledBatch(1, Operation.PRELUDE, (item, BatchItem("b", WorkKey.SPECULATIVE, (4, 5))))
    assert b.num_rows == 3 and b.work_keys == {WorkKey.DECODE_PRELUDE, WorkKey.SPECULATIVE}
    with pytest.raises(AttributeError):
        item.depth = 2  # immutable


def test_request_state_starts_waiting():
    assert st("a").status is RequestStatus.WAITING
