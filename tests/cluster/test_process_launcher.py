"""The plain-process launcher (no Ray: the GPU machine's path), 1P1D with real NIXL, and colocated."""

from __future__ import annotations

import asyncio

import pytest

from loopserve.cluster.cluster import Cluster, wait_idle
from loopserve.cluster.config import load_cluster_config
from loopserve.bench.workload import run_workload
from tests.cluster.conftest import colocated_reference, greedy_items



@pytest.mark.parametrize("config", ["configs/cpu-1p1d.yaml", "configs/colocated.yaml"])
def test_process_cluster_equals_colocated(config):
    cfg = load_cluster_config(config, launcher="process")
    engine = cfg.engine.model_dump(exclude={"scheduler": {"role"}}, exclude_defaults=True)
    items = greedy_items(4, seed=3)
    with Cluster(cfg) as cluster:
        procs = [h._proc for h in cluster.handles]
        results = asyncio.run(run_workload(cluster.router, items))
        usage = wait_idle(cluster.handles)
        late = cluster.handles[0]  # idle: a 2 s long poll cannot answer within 0.05 s
        with pytest.raises(TimeoutError):  # alive but late, not "gone" (TimeoutError is an OSError)
            late._call("get_events", 2.0, timeout=0.05)
        assert late.health(timeout=30)["ok"]
        if cfg.mode == "pd":
            d = next(h for h in cluster.handles if h.role == "decode")
            assert d.trace(items[0].request_id) == ["RECEIVING", "ACTIVE", "FINISHED"]
    ref = colocated_reference(items, engine)
    for it, res in zip(items, results):
        assert res.error is None and (res.token_ids, res.exit_depths) == ref[it.request_id]
    assert all(u["looped"]["used"] == 0 for u in usage.values())
    assert all(not p.is_alive() for p in procs)  # stop() leaves no worker process behind


def test_worker_start_failure_is_reported():
    from loopserve.cluster.process_launcher import ProcessWorkerHandle
    from loopserve.cluster.worker_spec import WorkerSpec

    h = ProcessWorkerHandle(WorkerSpec("colocated-0", "colocated", {"model": "no-such-model"}))
    try:
        with pytest.raises(Exception, match="no-such-model"):
            h.wait_ready(120)
    finally:
        h.kill()
