"""Worker faults on a real 2P2D Ray cluster with real NIXL transfers.

A worker killed while it holds a request (decode RECEIVING, prefill TRANSFERRING) or a READ
that never completes (its prefill peer is frozen with SIGSTOP): the request migrates to a
surviving worker and its tokens equal the uninterrupted reference; Ray restarts the dead
actor and the router uses it again; with no survivor, the stream ends with a clear error.
Every pool is back to baseline after each test (the conftest's autouse check).
"""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from loopserve.cluster.cluster import wait_idle
from loopserve.cluster.workload import WorkItem, run_workload
from loopserve.engine.sampling_params import SamplingParams
from tests.cluster.conftest import colocated_reference, greedy_items, until

ray = pytest.importorskip("ray")


def _holder(handles, request_id: str, status: str):
    """The worker whose trace of `request_id` is at `status` right now (waits for it)."""
    def find():
        return next((h for h in handles if h.trace(request_id)[-1:] == [status]), None)
    return until(find, 60, f"{request_id} {status}")


def _restarted(router, h) -> None:
    """Wait until Ray has restarted `h` and the router has taken it back."""
    until(lambda: _ok(h), 120, f"{h.worker_id} restart")
    until(lambda: router.health()[h.worker_id]["ok"], 60, f"router re-admitting {h.worker_id}")


def _ok(h) -> bool:
    try:
        return h.health(timeout=5)["ok"]
    except Exception:  # noqa: BLE001 - still restarting
        return False


def _check(items, results) -> None:
    ref = colocated_reference(items)
    for it, r in zip(items, results):
        assert r.error is None and r.finish_reason == "length", (it.request_id, r.error)
        assert (r.token_ids, r.exit_depths) == ref[it.request_id], it.request_id


def _kill_while(router, workers, role: str, status: str, items) -> tuple[object, list]:
    """Run `items`; kill (Ray restarts it) the `role` worker once items[0] is at `status`."""
    async def run():
        task = asyncio.create_task(run_workload(router, items))
        victim = await asyncio.to_thread(_holder, workers[role], items[0].request_id, status)
        ray.kill(victim.actor, no_restart=False)
        return victim, await task
    return asyncio.run(run())


@pytest.mark.parametrize("role,status", [("decode", "RECEIVING"), ("prefill", "TRANSFERRING")])
def test_killed_worker_requests_migrate_and_the_restarted_actor_is_used_again(
        fault_workers, make_router, role, status):
    router = make_router(fault_workers["prefill"], fault_workers["decode"])
    items = greedy_items(4, seed=21 if role == "decode" else 22, max_tokens=10)
    victim, results = _kill_while(router, fault_workers, role, status, items)
    _check(items, results)
    _restarted(router, victim)
    # The restarted worker (a new engine and NIXL agent, shaken hands again) serves again.
    again = greedy_items(6, seed=23 if role == "decode" else 24, max_tokens=4)
    _check(again, asyncio.run(run_workload(router, again)))
    assert victim.stats()["accepted"] > 0


def test_read_that_never_completes_times_out_and_the_request_migrates(fault_workers, make_router):
    """The prefill peer is frozen while the decode side's READ is held: the READ, posted to a
    process that cannot answer, hits read_timeout_s; the request continues elsewhere; once the
    peer resumes, the late READ retires and every block is freed."""
    router = make_router(fault_workers["prefill"], fault_workers["decode"])
    params = SamplingParams(max_tokens=8, ignore_eos=True, seed=5, exit_threshold=0.7)
    items = [WorkItem("frozen", [7, 3, 9, 1, 4, 4], params)]
    frozen = None

    async def run():
        nonlocal frozen
        task = asyncio.create_task(run_workload(router, items))
        reader = await asyncio.to_thread(_holder, fault_workers["decode"], "frozen", "RECEIVING")
        frozen = next(p for p in fault_workers["prefill"] if p.trace("frozen")[-1:] == ["TRANSFERRING"])
        failed_before = reader.stats()["kv_reads"]["failed"]
        pid = frozen.health()["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:  # held 1 s, then posted, then 3 s of read timeout
            results = await asyncio.wait_for(task, 25)  # served by the other pair meanwhile
            assert reader.trace("frozen") == ["RECEIVING", "FINISHED"]
        finally:
            os.kill(pid, signal.SIGCONT)
        assert reader.stats()["kv_reads"]["failed"] == failed_before + 1
        return results

    _check(items, asyncio.run(run()))
    wait_idle([frozen], timeout=60)


def test_no_surviving_decode_worker_ends_the_stream_with_a_clear_error(fault_workers, make_router):
    """1P1D, and the decode worker is killed while RECEIVING: the request is resubmitted, but
    its new handoff finds no decode worker (Ray takes seconds to restart one), so the stream
    ends with an error saying so and the prefill side frees its blocks at once."""
    p, d = fault_workers["prefill"][1], fault_workers["decode"][1]
    router = make_router([p], [d])
    params = SamplingParams(max_tokens=8, ignore_eos=True, seed=9)

    async def run():
        stream = router.generate([5, 6, 7, 8], params, "orphaned")
        task = asyncio.create_task(_collect(stream))
        await asyncio.to_thread(_holder, [d], "orphaned", "RECEIVING")
        ray.kill(d.actor, no_restart=False)
        return await task

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].finish_reason == "error"
    assert "no healthy decode worker" in outs[-1].error
    _restarted(router, d)


async def _collect(stream) -> list:
    return [o async for o in stream]
