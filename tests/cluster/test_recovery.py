"""Issue 38 finding 8: a failed worker comes back (the process launcher starts a new process,
Ray restarts the actor: `max_restarts` defaults to 3 for both), the router takes it back
into service once its event poll answers healthy, and a request whose prefill worker dies
after its first token was streamed continues (migrates) and completes with the
uninterrupted run's tokens: with no healthy prefill worker left, on a decode worker that
prefills it itself.

The scenario, on 1P1D with real NIXL for each launcher: the decode worker is frozen
(SIGSTOP) so the request's handoff cannot be read; once its first token has streamed the
prefill worker is killed (SIGKILL, a crash); the decode worker resumes. The request
completes on the decode worker; the prefill worker is started again and serves new
requests.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace

import pytest

from loopserve.bench.workload import run_workload
from loopserve.cluster.cluster import wait_idle
from loopserve.cluster.config import load_cluster_config
from loopserve.cluster.placement import launch, plan, stop_all
from loopserve.cluster.router.core import Router
from loopserve.protocol.sampling_params import SamplingParams
from tests.cluster.conftest import ENGINE, colocated_reference, greedy_items, until


def _config(launcher: str, **extra):
    return load_cluster_config({"mode": "pd", "launcher": launcher, "engine": ENGINE,
                                "prefill": {"num_workers": 1, "num_cpus": 0},
                                "decode": {"num_workers": 1, "num_cpus": 0}, **extra})


def _pid(handle) -> int:
    return handle.health(timeout=30)["pid"]


def _crash_prefill_after_first_token(router: Router, prefill, decode) -> list:
    """One greedy request: decode frozen, prefill killed once the first token streamed."""
    item = greedy_items(1, seed=61, max_tokens=12)[0]
    item = replace(item, params=replace(item.params, max_tokens=12))
    decode_pid, prefill_pid = _pid(decode), _pid(prefill)

    async def run() -> list:
        outs = []
        os.kill(decode_pid, signal.SIGSTOP)
        try:
            stream = router.generate(item.prompt, item.params, item.request_id)
            outs.append(await stream.__anext__())  # the prefill worker's first token
            os.kill(prefill_pid, signal.SIGKILL)
            await asyncio.to_thread(until, lambda: not router.health()[prefill.worker_id]["ok"],
                                    60, "prefill worker failed")
        finally:
            os.kill(decode_pid, signal.SIGCONT)
        outs.extend([o async for o in stream])
        return outs

    outs = asyncio.run(run())
    assert outs[-1].finished and outs[-1].error is None, outs[-1]
    tokens = [t for o in outs for t in o.new_token_ids]
    depths = [d for o in outs for d in o.exit_depths]
    assert (tokens, depths) == colocated_reference([item])[item.request_id]
    assert router.metrics.registry.get_sample_value("loopserve:request_migrations_total") >= 1
    return outs


def _comes_back_and_serves(router: Router, prefill, old_pid: int) -> None:
    until(lambda: router.health()[prefill.worker_id]["ok"], 300, "prefill worker back in service")
    assert _pid(prefill) != old_pid  # a new process
    items = greedy_items(4, seed=62, max_tokens=4)
    results = asyncio.run(run_workload(router, items))
    ref = colocated_reference(items)
    for it, r in zip(items, results):
        assert r.error is None and (r.token_ids, r.exit_depths) == ref[it.request_id], it.request_id
    assert prefill.stats(timeout=30).accepted >= len(items)  # the new process served them


def _scenario(handles) -> None:
    prefill = next(h for h in handles if h.role == "prefill")
    decode = next(h for h in handles if h.role == "decode")
    # A deadline far beyond the freeze: the handoff waits for the frozen decode worker.
    router = Router([prefill], [decode], poll_s=0.1, deadline_s=60, fail_s=600).start()
    try:
        old = _pid(prefill)
        _crash_prefill_after_first_token(router, prefill, decode)
        _comes_back_and_serves(router, prefill, old)
        usage = wait_idle(handles, timeout=60)
        assert all(u[p]["used"] == 0 for u in usage.values() for p in ("looped", "flat")), usage
    finally:
        router.close()


def test_process_launcher_restarts_a_crashed_worker_and_migrates_its_streaming_request():
    handles = launch(_config("process"))
    try:
        _scenario(handles)
    finally:
        stop_all(handles)


def test_ray_launcher_restarts_a_crashed_actor_by_default_and_migrates_its_streaming_request(ray_cluster):
    from loopserve.cluster.ray_launcher import RayWorkerHandle

    config = _config("ray")
    assert config.max_restarts > 0  # the default: a crashed actor comes back
    # As launch() makes them, under ids of their own (the session's workers hold the names).
    handles = [RayWorkerHandle(replace(s, worker_id=f"r{s.worker_id}"), config.max_restarts,
                               config.ray.max_concurrency) for s in plan(config)]
    try:
        for h in handles:
            h.wait_ready(300)
        _scenario(handles)
    finally:
        stop_all(handles)


def test_a_worker_out_of_restarts_stays_down_and_the_decode_worker_serves_alone():
    """max_restarts 0: the crashed prefill worker is not started again; the decode worker
    prefills new requests itself (DEGRADED, still serving)."""
    handles = launch(_config("process", max_restarts=0))
    prefill = next(h for h in handles if h.role == "prefill")
    decode = next(h for h in handles if h.role == "decode")
    router = Router([prefill], [decode], poll_s=0.1).start()
    try:
        os.kill(_pid(prefill), signal.SIGKILL)
        until(lambda: not router.health()[prefill.worker_id]["ok"], 60, "prefill worker failed")
        ok, status = router.serving()
        assert ok and status.startswith("DEGRADED") and prefill.worker_id in status, status
        items = greedy_items(3, seed=63, max_tokens=4)
        results = asyncio.run(run_workload(router, items))
        ref = colocated_reference(items)
        assert all(r.error is None and (r.token_ids, r.exit_depths) == ref[it.request_id]
                   for it, r in zip(items, results))
        assert not router.health()[prefill.worker_id]["ok"]  # still down: no restarts left
        assert prefill.restarts_left == 0 and not prefill._proc.is_alive()
    finally:
        router.close()
        stop_all(handles)
