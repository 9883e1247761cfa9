"""Worker faults on a real 2P2D Ray cluster with real NIXL transfers, and engines that fail.

A worker killed while it holds a request (decode RECEIVING, prefill TRANSFERRING) or a READ
that never completes (its prefill peer is frozen with SIGSTOP): the request migrates to a
surviving worker and its tokens equal the uninterrupted reference; Ray restarts the dead
actor and the router uses it again; with no survivor, the stream ends with a clear error.
Every pool is back to baseline after each test (the conftest's autouse check).
A worker whose engine step raises is handled as a dead one: its requests end at once and
migrate, and it is restarted (Ray) or stopped for good (a worker that cannot be restarted).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest

from loopserve.bench.workload import WorkItem, run_workload
from loopserve.cluster.cluster import wait_idle
from loopserve.cluster.config import load_cluster_config
from loopserve.cluster.placement import plan, stop_all
from loopserve.cluster.router.core import Router
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.protocol.status import NoWorkerError
from tests.cluster.conftest import ENGINE, FAULT_TRANSFER, colocated_reference, greedy_items, until
from tests.cluster.faulty import FAULT, FaultyHost, break_engine, fault_class
from tests.cluster.inprocess import InProcessHandle

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
    assert victim.stats().accepted > 0


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
        failed_before = reader.stats().decode.kv_reads.failed
        pid = frozen.health()["pid"]
        os.kill(pid, signal.SIGSTOP)
        try:  # held 1 s, then posted; 3 s after it started, the READ times out
            results = await asyncio.wait_for(task, 25)  # served by the other pair meanwhile
            assert reader.trace("frozen") == ["RECEIVING", "FINISHED"]
        finally:
            os.kill(pid, signal.SIGCONT)
        assert reader.stats().decode.kv_reads.failed == failed_before + 1
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
    assert "no healthy decode worker" in outs[-1].error and outs[-1].error_code == "UNAVAILABLE"
    if not router.health()[d.worker_id]["ok"]:  # not restarted yet: refused up front
        with pytest.raises(NoWorkerError, match="no healthy decode worker"):
            asyncio.run(_collect(router.generate([1, 2], params)))
        assert router.serving()[0] is False
    _restarted(router, d)


async def _collect(stream) -> list:
    return [o async for o in stream]


def _break_while(router, handles, items, brk) -> tuple[object, list]:
    """Run `items`; break the engine (`brk(handle)`) of the worker running items[0]."""
    async def run():
        task = asyncio.create_task(run_workload(router, items))
        victim = await asyncio.to_thread(_holder, handles, items[0].request_id, "ACTIVE")
        brk(victim)
        return victim, await task
    return asyncio.run(run())


def test_a_worker_whose_engine_step_raises_is_stopped_and_its_requests_migrate():
    """Two in-process workers (their handles cannot restart one): the broken worker's requests
    end at once and continue on the other (same tokens), it is stopped with nothing left
    unfinished, the survivor serves later requests; when it breaks too, a running stream
    ends with the engine's error and new requests find no worker."""
    handles = [InProcessHandle(f"breakable-{i}", ENGINE) for i in range(2)]
    router = Router(handles, poll_s=0.1).start()
    try:
        items = greedy_items(6, seed=25, max_tokens=48)
        victim, results = _break_while(router, handles, items, lambda h: break_engine(h.host))
        _check(items, results)
        assert victim.check_no_leaks()["unfinished"] is False
        assert FAULT in victim.health()["error"] and not router.health()[victim.worker_id]["ok"]
        survivor = next(h for h in handles if h is not victim)
        before = victim.stats().accepted
        again = greedy_items(4, seed=26, max_tokens=4)
        _check(again, asyncio.run(run_workload(router, again)))
        assert victim.stats().accepted == before

        params = SamplingParams(max_tokens=400, ignore_eos=True, seed=3)

        async def last_one():
            task = asyncio.create_task(_collect(router.generate([5, 6, 7, 8], params, "last")))
            await asyncio.to_thread(_holder, [survivor], "last", "ACTIVE")
            break_engine(survivor.host)
            return await task

        outs = asyncio.run(last_one())
        assert outs[-1].finish_reason == "error" and FAULT in outs[-1].error, outs[-1]
        assert "no healthy colocated worker" in outs[-1].error
        with pytest.raises(NoWorkerError):
            asyncio.run(_collect(router.generate([1, 2], params)))
    finally:
        router.close()
        stop_all(handles)


def test_a_decode_worker_whose_engine_step_raises_is_stopped_and_its_requests_migrate():
    """1P2D in this process, real NIXL, READs held 1 s: the broken decode worker also holds
    requests still RECEIVING. Every request completes through the other decode worker, the
    broken one is left with nothing, the survivors free every block."""
    p = InProcessHandle("breakable-p", ENGINE, "prefill", FAULT_TRANSFER)
    ds = [InProcessHandle(f"breakable-d{i}", ENGINE, "decode", FAULT_TRANSFER, fault_class) for i in range(2)]
    router = Router([p], ds, poll_s=0.1).start()
    try:
        items = greedy_items(6, seed=29, max_tokens=32)
        victim, results = _break_while(router, ds, items, lambda h: break_engine(h.host))
        _check(items, results)
        assert victim.check_no_leaks()["unfinished"] is False
        again = greedy_items(4, seed=30, max_tokens=4)
        _check(again, asyncio.run(run_workload(router, again)))
        wait_idle([p, *(d for d in ds if d is not victim)], timeout=60)
    finally:
        router.close()
        stop_all([p, *ds])


def test_a_ray_worker_whose_engine_step_raises_is_restarted_and_used_again(ray_cluster, monkeypatch):
    from loopserve.cluster import ray_launcher

    monkeypatch.setattr(ray_launcher, "worker_class", lambda role: FaultyHost)
    cfg = load_cluster_config({"mode": "colocated", "launcher": "ray", "engine": ENGINE,
                               "colocated": {"num_workers": 2}})
    handles = [ray_launcher.RayWorkerHandle(replace(s, worker_id=f"faulty-{s.worker_id}", num_cpus=0),
                                            max_restarts=1) for s in plan(cfg)]
    router = None
    try:
        for h in handles:
            h.wait_ready(120)
        router = Router(handles, poll_s=0.1).start()
        items = greedy_items(6, seed=27, max_tokens=48)
        victim, results = _break_while(router, handles, items, lambda h: h._call("break_engine"))
        _check(items, results)
        _restarted(router, victim)
        again = greedy_items(6, seed=28, max_tokens=4)
        _check(again, asyncio.run(run_workload(router, again)))
        assert victim.stats().accepted > 0  # the restarted actor counts from 0
    finally:
        if router is not None:
            router.close()
        stop_all(handles)


@contextlib.contextmanager
def _stopped(handle):
    """The worker's process frozen (SIGSTOP) for the block: alive, answering nothing."""
    pid = handle.health()["pid"]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_stopped_worker_is_routed_around_and_stalls_nothing(pd_workers, make_router, role):
    """2P2D, one worker frozen: calls to it miss their deadline, it is routed around (its
    submits and handoffs go to the other worker of its role), every request completes
    while it is still frozen (it is failed only after fail_s, far later), Health answers from
    the router's view saying DEGRADED, and stats report it without waiting on it. Once it
    resumes it serves again, and whatever reached it late is let go (0 blocks)."""
    router = make_router(pd_workers["prefill"], pd_workers["decode"], deadline_s=1.0, fail_s=600)
    victim = pd_workers[role][0]
    items = greedy_items(10, seed=41 if role == "prefill" else 42, max_tokens=6)
    with _stopped(victim):
        results = asyncio.run(run_workload(router, items))  # while frozen
        until(lambda: not router.health()[victim.worker_id]["ok"], 10, "victim marked unresponsive")
        ok, status = router.serving()
        assert ok and status.startswith("DEGRADED") and victim.worker_id in status, status
        stats = router.stats()
        assert "did not answer" in stats[victim.worker_id].error, stats[victim.worker_id]
        assert all(s.engine is not None for w, s in stats.items() if w != victim.worker_id)
    _check(items, results)
    until(lambda: router.health()[victim.worker_id]["ok"], 30, "resumed worker routable")
    again = greedy_items(6, seed=43, max_tokens=3)
    _check(again, asyncio.run(run_workload(router, again)))


def test_stats_and_metrics_of_a_stopped_worker_answer_within_the_deadline_of_each_call(
        pd_workers, make_router):
    """Issue 38 finding 4: 12 concurrent stats calls (GetStats) and 12 concurrent /metrics
    renders while a decode worker is frozen each answer within the deadline counted from the
    call's own arrival (a 2x margin for a busy machine: the old 4 threads per worker answered
    the last of 12 after 3 deadlines), reporting the frozen worker as silent and the others in
    full; and requests sent meanwhile complete on the other decode worker while it is still
    frozen (observability never takes the threads handoffs use)."""
    deadline = 3.0
    router = make_router(pd_workers["prefill"][:1], pd_workers["decode"], deadline_s=deadline, fail_s=600)
    victim = pd_workers["decode"][0].worker_id
    items = greedy_items(6, seed=45, max_tokens=4)

    def timed_stats() -> tuple[float, dict]:
        t0 = time.monotonic()
        got = router.stats()
        return time.monotonic() - t0, got

    async def timed_render() -> tuple[float, bytes]:
        t0 = time.monotonic()
        text = await router.render_metrics()
        return time.monotonic() - t0, text

    async def scrapes_and_requests():
        renders = [asyncio.create_task(timed_render()) for _ in range(12)]
        results = await run_workload(router, items)
        return await asyncio.gather(*renders), results

    with _stopped(pd_workers["decode"][0]):
        with ThreadPoolExecutor(12) as pool:
            stats = list(pool.map(lambda _: timed_stats(), range(12)))
        for took, st in stats:
            assert took < 2 * deadline, [round(t, 1) for t, _ in stats]
            assert "did not answer" in st[victim].error and not st[victim].healthy, st[victim]
            assert all(s.engine is not None and s.healthy for w, s in st.items() if w != victim), st
        renders, results = asyncio.run(scrapes_and_requests())
    for took, text in renders:
        assert took < 2 * deadline, [round(t, 1) for t, _ in renders]
        healthy = [line for line in text.decode().splitlines()
                   if line.startswith("loopserve:worker_healthy{") and f'worker="{victim}"' in line]
        assert len(healthy) == 1 and healthy[0].endswith(" 0.0"), healthy
    _check(items, results)


def test_a_worker_silent_past_fail_s_is_failed_and_its_requests_migrate(fault_workers, make_router):
    """The prefill worker holding a request freezes: after fail_s the router fails it, the
    request continues on the other prefill worker (same tokens), and the frozen actor is
    killed for Ray to restart, after which the router uses it again."""
    router = make_router(fault_workers["prefill"], fault_workers["decode"], deadline_s=1.0, fail_s=3.0)
    long = WorkItem("silent-long", list(range(3, 163)), SamplingParams(max_tokens=6, ignore_eos=True, seed=44))
    items = [long, *greedy_items(2, seed=44, max_tokens=6)]  # 160 tokens: 40 prefill chunks of 4

    async def run():
        task = asyncio.create_task(run_workload(router, items))
        victim = await asyncio.to_thread(_holder, fault_workers["prefill"], long.request_id, "ACTIVE")
        os.kill(victim.health(timeout=5)["pid"], signal.SIGSTOP)  # SIGKILL (the restart) ends it
        return victim, await task

    victim, results = asyncio.run(run())
    _check(items, results)
    assert "did not answer" in (router.health()[victim.worker_id]["error"] or "")
    _restarted(router, victim)
