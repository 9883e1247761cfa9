"""Task prompts through the default 1P1D cluster (plain processes, real NIXL) give the same
tokens and exit depths as one colocated engine, so PD keeps the trained model's accuracy."""

from __future__ import annotations

import asyncio

from loopserve.bench.workload import WorkItem, run_workload
from loopserve.checkpoints.chains import make_problems
from loopserve.cluster.cluster import Cluster
from loopserve.cluster.config import load_cluster_config
from loopserve.protocol.sampling_params import SamplingParams
from tests.cluster.conftest import colocated_reference


def test_1p1d_answers_like_colocated():
    cfg = load_cluster_config("configs/cpu-1p1d.yaml", launcher="process")
    assert cfg.engine.model == "tiny-ouro-chains"
    engine = cfg.engine.model_dump(exclude={"role"}, exclude_defaults=True)
    problems = make_problems(1234, 12)
    items = [WorkItem(f"chain-{i}-{t}", p.prompt, SamplingParams(max_tokens=2, exit_threshold=t))
             for i, p in enumerate(problems) for t in (1.0, 0.9)]
    with Cluster(cfg) as cluster:
        results = asyncio.run(run_workload(cluster.router, items))
    ref = colocated_reference(items, engine)
    for it, res in zip(items, results):
        assert res.error is None and (res.token_ids, res.exit_depths) == ref[it.request_id], it
