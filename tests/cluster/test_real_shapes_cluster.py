"""The cluster at real shapes: prompts past every initial capacity (tests/real_shapes.py), more
requests than max_num_seqs, on worker processes (colocated, and 1P1D with a real NIXL READ of
every plane), through the router and then the gRPC server: the dense reference's greedy tokens and exit depths."""

from __future__ import annotations

import asyncio

import pytest

from loopserve.cluster.cluster import Cluster, wait_idle
from loopserve.cluster.config import load_cluster_config
from loopserve.bench.workload import WorkItem, run_workload
from tests.cluster.conftest import serving
from tests.engine.conftest import reference
from tests.real_shapes import ENGINE, workload


@pytest.mark.parametrize("family", ["tiny-huginn", "tiny-ouro"])
@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_process_cluster_at_long_prompts_matches_dense_reference(mode, family):
    cfg = load_cluster_config({"mode": mode, "launcher": "process", "engine": {"model": family, **ENGINE}})
    items = [WorkItem(it.request_id, it.prompt, it.params) for it in workload()]
    with Cluster(cfg) as cluster:
        results = asyncio.run(run_workload(cluster.router, items))
        longest = max(items, key=lambda it: len(it.prompt))
        with serving(cluster.router) as client:
            events = list(client.generate(longest.prompt, longest.params, request_id="grpc"))
        usage = wait_idle(cluster.handles)
        if mode == "pd":
            d = next(h for h in cluster.handles if h.role == "decode")
            assert all(d.trace(it.request_id)[-1] == "FINISHED" for it in items)
    for it, res in zip(items, results):
        assert res.error is None, (it.request_id, res.error)
        want = reference(family, it.prompt, it.params)
        assert (res.token_ids, res.exit_depths) == tuple(map(list, want)), f"{it.request_id} ({len(it.prompt)} tokens)"
    chunks = [e for e in events if e.kind == "chunk"]
    assert events[-1].kind == "complete", events[-1]
    got = ([t for c in chunks for t in c.token_ids], [x for c in chunks for x in c.exit_depths])
    assert got == tuple(map(list, reference(family, longest.prompt, longest.params)))
    assert all(u[p]["used"] == 0 for u in usage.values() for p in ("looped", "flat"))
