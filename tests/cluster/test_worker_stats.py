"""A worker's stats are typed (`protocol/stats.py`), cross processes as plain data, and carry
their health explicitly: the router, the metrics and the gRPC front read fields, not keys."""

from __future__ import annotations

import asyncio
import json

from loopserve.entrypoints.grpc.server import _worker_stats
from loopserve.metrics import WorkerCollector
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.protocol.stats import WorkerStats


async def _run_one(router) -> None:
    async for _ in router.generate([1, 2, 3, 4, 5], SamplingParams(max_tokens=4, ignore_eos=True)):
        pass


def test_stats_are_plain_data_on_the_wire_and_typed_at_the_handle(colocated_worker):
    wire = colocated_worker.host.stats()  # what Ray or the process launcher carries
    assert json.loads(json.dumps(wire)) == json.loads(json.dumps(WorkerStats.from_dict(wire).to_dict()))
    s = colocated_worker.stats()
    assert isinstance(s, WorkerStats) and s == WorkerStats.from_dict(s.to_dict())
    assert s.healthy and s.error is None and s.role == "colocated"
    assert s.engine.looped.total == s.engine.looped.free + s.engine.looped.used > 0
    assert s.prefill is None and s.decode is None


def test_router_stats_report_an_unanswered_worker_unhealthy(colocated_router, colocated_worker):
    asyncio.run(_run_one(colocated_router))
    stats = colocated_router.stats()
    s = stats[colocated_worker.worker_id]
    assert s.healthy and s.accepted >= 1 and s.engine.counters.tokens_generated >= 4
    gone = WorkerStats.unanswered("gone", "decode", "did not answer within 1 s of the call")
    collector = WorkerCollector(lambda: {**stats, "gone": gone})
    healthy = {smp.labels["worker"]: smp.value for smp in next(collector.collect()).samples}
    assert healthy == {colocated_worker.worker_id: 1.0, "gone": 0.0}
    running = [m for m in collector.collect() if m.name == "loopserve:num_requests_running"][0]
    assert [smp.labels["worker"] for smp in running.samples] == [colocated_worker.worker_id]
    assert _worker_stats("gone", gone).healthy is False
    assert _worker_stats(colocated_worker.worker_id, s).pool_accounting_ok
