"""Placement: the xPyD worker specs of a config, checked against what the cluster has, launched.

An impossible placement fails before any worker starts, naming the group and the resource.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from loopserve.cluster.config import ClusterConfig
from loopserve.cluster.handle import WorkerHandle
from loopserve.cluster.worker_spec import START_TIMEOUT_S, WorkerSpec


class PlacementError(ValueError):
    pass


def worker_env(config: ClusterConfig) -> dict[str, str]:
    """Environment every worker gets: UCX over loopback for CPU KV, and the package on its path
    where this machine's checkout is what workers run (not under a Ray job's working_dir,
    which Ray puts on the path itself, on every node)."""
    env = {}
    existing_ray = config.launcher == "ray" and (config.ray.address or os.environ.get("RAY_ADDRESS"))
    if not existing_ray:
        here = str(Path(__file__).resolve().parents[2])  # the directory holding loopserve/
        env["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    if config.mode == "pd" and all(config.engine_config(r).device == "cpu" for r in config.roles()):
        env.update({"UCX_TLS": os.environ.get("UCX_TLS", "tcp,cma"),
                    "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES", "lo")})
    return env


def plan(config: ClusterConfig) -> list[WorkerSpec]:
    env = worker_env(config)
    transfer = config.transfer.model_dump()
    specs = []
    for role in config.roles():
        g = config.group(role)
        engine = config.engine_config(role).model_dump(exclude={"scheduler": {"role"}})
        # Each worker's torch uses its own CPUs only (as Ray does for actors): workers of one
        # machine would otherwise each start a thread per core and thrash.
        threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", str(max(1, int(g.num_cpus))))}
        for i in range(g.num_workers):
            specs.append(WorkerSpec(f"{role}-{i}", role, engine, transfer, g.num_cpus, g.num_gpus,
                                    {**env, **threads}))
    return specs


def pin_gpus(specs: Sequence[WorkerSpec]) -> list[WorkerSpec]:
    """Plain processes: give each GPU worker its devices (CUDA_VISIBLE_DEVICES), as Ray would.

    Workers are packed in order on a line of GPUs: [0, 0.5) and [0.5, 1) share GPU 0, two
    workers of 1 GPU get GPUs 0 and 1, a whole-GPU worker starts on a fresh GPU. Indices go through the launcher's own
    CUDA_VISIBLE_DEVICES when it has one.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else None
    out, start = [], 0.0
    for s in specs:
        if s.num_gpus <= 0:
            out.append(s)
            continue
        if s.num_gpus >= 1:  # whole GPUs: never straddle one that a fraction is using
            start = math.ceil(start - 1e-9)
        end = start + s.num_gpus
        first, last = int(start + 1e-9), max(int(start + 1e-9), math.ceil(end - 1e-9) - 1)
        gpus = [ids[i] if ids else str(i) for i in range(first, last + 1)]
        out.append(replace(s, env={**s.env, "CUDA_VISIBLE_DEVICES": ",".join(gpus)}))
        start = end
    return out


def check_fit(specs: Sequence[WorkerSpec], nodes: Sequence[dict[str, float]],
              resources: Sequence[str] = ("GPU", "CPU")) -> None:
    """Raise PlacementError unless the workers' `resources` fit the nodes.

    A per-worker check (no node is big enough) and a total check; Ray places the actors
    itself, these catch the impossible cases up front.
    """
    for res in resources:
        key = f"num_{res.lower()}s"
        need = {s.role: 0.0 for s in specs}
        for s in specs:
            need[s.role] += getattr(s, key)
        total_need = sum(need.values())
        have = sum(n.get(res, 0.0) for n in nodes)
        biggest = max((n.get(res, 0.0) for n in nodes), default=0.0)
        for s in specs:
            if getattr(s, key) > biggest:
                raise PlacementError(
                    f"{s.role}.{key} = {getattr(s, key)} but the largest node has {biggest} {res}")
        if total_need > have + 1e-9:
            detail = ", ".join(f"{r}: {sum(1 for s in specs if s.role == r)} x "
                               f"{next(getattr(s, key) for s in specs if s.role == r)}"
                               for r in need)
            raise PlacementError(f"placement needs {total_need:g} {res} ({detail}) but the "
                                 f"cluster has {have:g}")


def launch(config: ClusterConfig) -> list[WorkerHandle]:
    """Start every worker of the config and wait until all are ready (or stop them all)."""
    specs = plan(config)
    if config.launcher == "ray":
        from loopserve.cluster.ray_launcher import RayWorkerHandle, ensure_ray, ray_nodes

        ensure_ray(config.ray)  # the caller may have connected already (then a no-op)
        check_fit(specs, ray_nodes())
        handles: list[WorkerHandle] = [
            RayWorkerHandle(s, config.max_restarts, config.ray.max_concurrency) for s in specs]
    else:
        check_fit(specs, [local_node()], resources=("GPU",))  # processes share CPUs freely
        specs = pin_gpus(specs)
        from loopserve.cluster.process_launcher import ProcessWorkerHandle

        handles = [ProcessWorkerHandle(s, config.max_restarts) for s in specs]
    try:
        with ThreadPoolExecutor(len(handles)) as pool:
            list(pool.map(lambda h: h.wait_ready(START_TIMEOUT_S), handles))
    except BaseException:
        stop_all(handles)
        raise
    return handles


def local_node() -> dict[str, float]:
    """This machine's GPUs (for the plain-process launcher)."""
    import torch

    return {"GPU": float(torch.cuda.device_count() if torch.cuda.is_available() else 0)}


def stop_all(handles: Sequence[WorkerHandle]) -> None:
    def stop(h: WorkerHandle) -> None:
        try:
            h.shutdown()
        except Exception:  # noqa: BLE001 - already gone: kill() ran in shutdown's finally
            pass

    if handles:
        with ThreadPoolExecutor(len(handles)) as pool:
            list(pool.map(stop, handles))
