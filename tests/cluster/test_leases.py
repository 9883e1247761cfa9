"""Leases and backpressure across real processes: a handoff nobody reads is freed when its
lease runs out; a decode worker short of blocks keeps handoffs queued and renews their
leases until it can read them."""

from __future__ import annotations

import asyncio
import time

from loopserve.bench.workload import WorkItem, run_workload
from loopserve.cluster.cluster import Cluster, wait_idle
from loopserve.cluster.config import load_cluster_config
from loopserve.cluster.process_launcher import ProcessWorkerHandle
from loopserve.cluster.worker_spec import WorkerSpec
from loopserve.protocol.sampling_params import SamplingParams
from tests.cluster.conftest import colocated_reference

ENGINE = {"model": "tiny-ouro", "block_size": 4, "num_blocks": 256, "max_model_len": 256}


def test_unread_handoff_is_freed_when_its_lease_expires():
    h = ProcessWorkerHandle(WorkerSpec("prefill-lease", "prefill", ENGINE, {"lease_s": 0.5}))
    try:
        h.wait_ready(120)
        assert h.submit("orphan", [5, 6, 7, 8, 9], SamplingParams(max_tokens=8))
        handoffs, deadline = [], time.monotonic() + 30
        while not handoffs and time.monotonic() < deadline:
            handoffs = h.get_events(0.5).handoffs
        assert [m.request_id for m in handoffs] == ["orphan"]
        assert h.stats().engine.looped.used > 0  # held for the reader that never comes
        deadline = time.monotonic() + 30
        while h.check_no_leaks()["unfinished"]:
            assert time.monotonic() < deadline, "lease never expired"
            time.sleep(0.1)
        s = h.stats()
        assert s.prefill.leases_expired == 1 and s.engine.looped.used == 0
        assert h.trace("orphan") == ["WAITING", "ACTIVE", "TRANSFERRING", "FINISHED"]
    finally:
        h.shutdown()


def test_queued_handoffs_are_renewed_while_decode_is_short_of_blocks():
    lease = 0.6
    cfg = load_cluster_config({
        "launcher": "process", "engine": ENGINE,
        "decode": {"engine": {"num_blocks": 200}},  # one request (4 loops x 40 blocks) at a time
        "transfer": {"lease_s": lease, "heartbeat_s": 0.1, "read_timeout_s": 20}})
    # long enough that the last handoff waits out two others' decodes, > 2 leases on a fast machine
    params = SamplingParams(max_tokens=150, ignore_eos=True, max_loops=4, exit_threshold=1.0)
    items = [WorkItem(f"q{i}", [10 + i] * 10, params) for i in range(3)]
    with Cluster(cfg) as cluster:
        results = asyncio.run(run_workload(cluster.router, items))
        wait_idle(cluster.handles)
        p = next(h for h in cluster.handles if h.role == "prefill")
        assert p.stats().prefill.leases_expired == 0
    # Some handoff waited in the decode inbox for longer than several leases...
    assert max(r.done - r.first_token for r in results) > 2 * lease
    ref = colocated_reference(items, ENGINE)  # ...and still decoded from intact KV
    for it, r in zip(items, results):
        assert r.error is None and (r.token_ids, r.exit_depths) == ref[it.request_id]


def test_handoff_the_decode_side_refuses_is_freed_at_once_not_when_its_lease_runs_out():
    """(b): a decode worker that cannot ever fit a request refuses it before reading; its
    `release` note frees the prefill side's blocks right away (the lease is 60 s), the
    router retries once and then ends the stream with the decode side's reason."""
    lease = 60.0
    cfg = load_cluster_config({
        "launcher": "process", "engine": ENGINE,
        "decode": {"engine": {"num_blocks": 16}},  # fewer than the request will ever need
        "transfer": {"lease_s": lease, "heartbeat_s": 0.5, "read_timeout_s": 20},
        "server": {"max_migrations": 1}})
    params = SamplingParams(max_tokens=40, ignore_eos=True, max_loops=4, exit_threshold=1.0)
    with Cluster(cfg) as cluster:
        [r] = asyncio.run(run_workload(cluster.router, [WorkItem("too-big", [3] * 20, params)]))
        wait_idle(cluster.handles, timeout=lease / 4)
        p = next(h for h in cluster.handles if h.role == "prefill")
        assert p.stats().prefill.leases_expired == 0
        assert p.trace("too-big") == ["WAITING", "ACTIVE", "TRANSFERRING", "FINISHED"]
    assert r.finish_reason == "error"
    assert "needs" in r.error and "KV blocks" in r.error and "after 1 migration" in r.error, r.error
