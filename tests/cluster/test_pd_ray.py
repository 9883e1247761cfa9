"""PD on a real local Ray cluster with real NIXL READs over loopback, against colocated."""

from __future__ import annotations

import asyncio
from collections import Counter

from loopserve.cluster.cluster import wait_idle
from loopserve.bench.workload import run_workload
from tests.cluster.conftest import colocated_reference, greedy_items

PREFILL_TRACE = ["WAITING", "ACTIVE", "TRANSFERRING", "FINISHED"]
DECODE_TRACE = ["RECEIVING", "ACTIVE", "FINISHED"]


def _check_run(router, prefill, decode, items):
    results = asyncio.run(run_workload(router, items))
    assert router.num_live() == 0
    ref = colocated_reference(items)
    served = Counter()
    for it, res in zip(items, results):
        assert res.error is None, res.error
        assert res.finish_reason == "length"
        assert (res.token_ids, res.exit_depths) == ref[it.request_id], it.request_id
        # Every request's statuses, in order, on the one prefill / decode worker that had it.
        p_traces = {h.worker_id: h.trace(it.request_id) for h in prefill}
        d_traces = {h.worker_id: h.trace(it.request_id) for h in decode}
        (pw, p_trace), = [(w, t) for w, t in p_traces.items() if t]
        if it.params.max_tokens == 1:  # done at the first token: no handoff at all
            assert p_trace == ["WAITING", "ACTIVE", "FINISHED"]
            assert not any(d_traces.values())
            continue
        (dw, d_trace), = [(w, t) for w, t in d_traces.items() if t]
        assert p_trace == PREFILL_TRACE and d_trace == DECODE_TRACE, (p_trace, d_trace)
        served[pw] += 1
        served[dw] += 1
    usage = wait_idle(prefill + decode)  # also raises if an idle engine still holds blocks
    for w, u in usage.items():
        assert u["looped"]["used"] == 0 and u["flat"]["used"] == 0, (w, u)
    return served


def test_1p1d_greedy_equals_colocated(pd_workers, make_router):
    p, d = pd_workers["prefill"][:1], pd_workers["decode"][:1]
    items = greedy_items(6, seed=1)
    served = _check_run(make_router(p, d), p, d, items)
    assert served == {p[0].worker_id: 5, d[0].worker_id: 5}


def test_2p2d_greedy_equals_colocated_and_spreads_load(pd_workers, make_router):
    p, d = pd_workers["prefill"], pd_workers["decode"]
    before = {h.worker_id: h.stats().decode.kv_reads.count for h in d}
    items = greedy_items(9, seed=2)
    served = _check_run(make_router(p, d), p, d, items)
    assert set(served) == {h.worker_id for h in p + d}, served  # every worker took requests
    reads = {h.worker_id: h.stats().decode.kv_reads for h in d}
    assert sum(r.count - before[w] for w, r in reads.items()) == 8
    assert all(r.failed == 0 and r.bytes > 0 for r in reads.values())
