"""Shared fixtures: ONE local Ray cluster per session, and 2 prefill + 2 decode Ray workers on it.

Starting Ray (~5 s) and a worker (torch + model + NIXL agent, several seconds) is the slow
part, so tests build routers over subsets of the same workers (1P1D = one of each). Only one
router may pump a worker at a time: every test closes its router. Tests of the server's own
edge (validation, backpressure, security) use one in-process colocated worker instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from dataclasses import replace

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

# Before any test module imports ray (it reads its settings at import): as for a cluster the
# product starts, loopback only and a fresh token.
with contextlib.suppress(ImportError):  # without ray, its tests skip themselves
    from loopserve.cluster import ray_launcher  # noqa: F401

from loopserve.cluster.cluster import wait_idle  # noqa: E402
from loopserve.cluster.config import load_cluster_config  # noqa: E402
from loopserve.cluster.placement import launch, plan, stop_all  # noqa: E402
from loopserve.cluster.router.core import Router  # noqa: E402
from loopserve.engine.engine_core import EngineCore  # noqa: E402
from loopserve.protocol.sampling_params import SamplingParams  # noqa: E402

# tiny-huginn has both pools (flat prelude/coda planes and looped planes): every plane moves.
ENGINE = {"model": "tiny-huginn", "block_size": 4, "num_blocks": 1024, "max_model_len": 512,
          "max_num_seqs": 16}


def pd_config(**overrides):
    return load_cluster_config({"mode": "pd", "launcher": "ray", "engine": ENGINE,
                                "prefill": {"num_workers": 2, "num_cpus": 1},
                                "decode": {"num_workers": 2, "num_cpus": 1},
                                "transfer": {"lease_s": 20, "heartbeat_s": 0.5, "read_timeout_s": 20},
                                **overrides})


@pytest.fixture(scope="session")
def ray_cluster():
    """The product's private cluster (`ensure_ray` without an address)."""
    import ray

    from loopserve.cluster.config import RayConfig
    from loopserve.cluster.ray_launcher import ensure_ray

    head = ensure_ray(RayConfig(num_cpus=6))
    yield ray
    head.stop()


@pytest.fixture(scope="session")
def pd_workers(ray_cluster):
    """{'prefill': [p0, p1], 'decode': [d0, d1]} Ray worker handles."""
    handles = launch(pd_config())
    yield {role: [h for h in handles if h.role == role] for role in ("prefill", "decode")}
    stop_all(handles)


FAULT_TRANSFER = {"lease_s": 20, "heartbeat_s": 0.3, "read_timeout_s": 3}  # READs held: faulty.py


@pytest.fixture(scope="session")
def fault_workers(ray_cluster):
    """{'prefill': [fp0, fp1], 'decode': [fd0, fd1]}: Ray workers the fault tests may kill
    (Ray restarts them), with every KV READ held for 1 s so requests sit in RECEIVING /
    TRANSFERRING, and prefill engines that admit one request at a time in 4-token chunks."""
    from loopserve.cluster import ray_launcher
    from tests.cluster.faulty import fault_class

    cfg = pd_config(transfer=FAULT_TRANSFER, prefill={"num_workers": 2, "engine": {
        "max_num_seqs": 1, "split_prefill": True, "prefill_chunk_size": 4}})
    specs = [replace(s, worker_id=f"f{s.worker_id}", num_cpus=0.5) for s in plan(cfg)]
    with pytest.MonkeyPatch.context() as mp:  # the actor class Ray also restarts them as
        mp.setattr(ray_launcher, "worker_class", fault_class)
        handles = [ray_launcher.RayWorkerHandle(s, max_restarts=8) for s in specs]
    for h in handles:
        h.wait_ready(120)
    yield {role: [h for h in handles if h.role == role] for role in ("prefill", "decode")}
    stop_all(handles)


@pytest.fixture(scope="session")
def colocated_worker():
    """One colocated worker of the tiny model, in this process (no Ray)."""
    from tests.cluster.inprocess import InProcessHandle

    handle = InProcessHandle("colocated-inproc", ENGINE)
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def colocated_router(colocated_worker):
    """A router over the in-process worker that all of a module's servers share (a second
    router pumping the same worker would take half its events)."""
    router = Router([colocated_worker], poll_s=0.1).start()
    yield router
    router.close()


@pytest.fixture(autouse=True)
def pools_back_to_baseline(request):
    """(d) of the issue: after every test on shared workers, every pool's accounting holds
    (free + used == total) and no block is held once the workers are idle."""
    yield
    for name in ("pd_workers", "fault_workers", "colocated_worker"):
        if name in request.fixturenames:
            workers = request.getfixturevalue(name)
            handles = [h for hs in workers.values() for h in hs] if isinstance(workers, dict) else [workers]
            usage = wait_idle(handles, timeout=60)
            assert all(u[p]["used"] == 0 for u in usage.values() for p in ("looped", "flat")), usage


@contextlib.contextmanager
def running(server):
    """`server` (anything with async start() and stop()) started in its own event loop's thread;
    yields it started."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)


@contextlib.contextmanager
def serving(router, client_options: dict | None = None, **server_options):
    """A real gRPC server over `router` on a free port, in its own event loop; yields a client
    (made with `client_options`). `server_options` are ServerConfig fields."""
    from loopserve.cluster.config import ServerConfig
    from loopserve.entrypoints.grpc.client import LoopServeClient
    from loopserve.entrypoints.grpc.server import Server

    with running(Server(router, ServerConfig(**{"port": 0, **server_options}))) as server:
        client = LoopServeClient(server.address, **(client_options or {}))
        try:
            yield client
        finally:
            client.close()


@contextlib.contextmanager
def http_serving(router, engine: dict = ENGINE, **server_options):
    """The OpenAI-compatible HTTP server over `router` on a free port, in its own event loop;
    yields it (`.url`). `server_options` are ServerConfig fields."""
    from loopserve.cluster.config import ServerConfig
    from loopserve.engine.config import EngineConfig
    from loopserve.entrypoints.openai.server import HttpServer

    config = ServerConfig(**{"http_port": 0, **server_options})
    with running(HttpServer(router, config, EngineConfig(**engine))) as server:
        yield server


@contextlib.contextmanager
def served_1p1d(workers: dict):
    """(client, prefill handle, decode handle): a server over a 1P1D router of `workers`."""
    p, d = workers["prefill"][0], workers["decode"][0]
    router = Router([p], [d], poll_s=0.1).start()
    try:
        with serving(router) as client:
            yield client, p, d
    finally:
        router.close()


def until(cond, timeout: float = 30.0, what: str = "condition"):
    """Poll `cond` until it returns something truthy (returned), or fail after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.02)
    return got


@pytest.fixture
def make_router():
    routers = []

    def make(entry, decode=(), **kw):
        r = Router(entry, decode, poll_s=0.1, **kw).start()
        routers.append(r)
        return r

    yield make
    for r in routers:
        r.close()


_ref_engines: dict[str, EngineCore] = {}


def colocated_reference(items, engine: dict = ENGINE) -> dict[str, tuple[list[int], list[int]]]:
    """Tokens and exit depths of every item on one in-process colocated engine (the oracle)."""
    key = repr(sorted(engine.items()))
    if key not in _ref_engines:
        cfg = load_cluster_config({"mode": "colocated", "engine": engine}).engine_config("colocated")
        _ref_engines[key] = EngineCore(cfg)
    eng = _ref_engines[key]
    for it in items:
        eng.add_request(it.prompt, it.params, f"ref-{it.request_id}")
    got: dict[str, tuple[list[int], list[int]]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            toks, depths = got.setdefault(o.request_id[4:], ([], []))
            toks.extend(o.new_token_ids)
            depths.extend(o.exit_depths)
    eng.check_no_leaks()
    return got


def greedy_items(n: int, seed: int = 0, max_tokens: int = 8):
    """Greedy requests with mixed prompts and loop params (adaptive exit: depths differ).

Seeds are explicit: Huginn's initial loop state is seeded per request, and an engine picks
unseeded requests' seeds from its own stream.
"""
    import random

    from loopserve.bench.workload import WorkItem

    rng = random.Random(seed)
    items = []
    for i in range(n):
        prompt = [rng.randrange(0, 256) for _ in range(rng.choice([1, 3, 6, 11, 19]))]
        params = SamplingParams(max_tokens=1 if i == n - 1 else max_tokens, ignore_eos=True,
                                min_loops=rng.choice([1, 2]), max_loops=rng.choice([None, 3]),
                                exit_threshold=rng.choice([0.5, 0.7, 1.0]), seed=1000 * seed + i)
        items.append(WorkItem(f"s{seed}-{i}", prompt, params))
    return items
