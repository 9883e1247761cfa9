"""Load through the real gRPC server: N concurrent Generate streams (default 1000) from an
asyncio grpc.aio client, against a 1P1D CPU cluster of the tiny model (Ray launcher, KV moved
with NIXL), with short prompts and few tokens.

Reports errors (must be 0), TTFT and end-to-end p50 / p99 (and their ratio to the same
request's latency on the idle cluster, measured first in the same run), throughput, and every
pool's used blocks once the workers are idle, read with GetStats (must be 0: no leak). Exits
non-zero if either must fails. Prints the command.

Usage: python benchmarks/load_grpc.py [--requests 1000] [--concurrency 1000] [--max-tokens 4]
       [--model tiny-ouro] [--seed 0]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from dataclasses import dataclass

import grpc

from loopserve.bench.workload import WorkItem, make_workload, percentile
from loopserve.cluster.cluster import Cluster
from loopserve.cluster.config import load_cluster_config
from loopserve.entrypoints.grpc.proto import loopserve_pb2 as pb
from loopserve.entrypoints.grpc.proto import loopserve_pb2_grpc as pb_grpc
from loopserve.entrypoints.grpc.protocol import request_to_proto
from loopserve.entrypoints.grpc.server import Server

IDLE_TIMEOUT_S = 60.0


@dataclass
class Sample:
    start: float
    first: float | None = None
    done: float | None = None
    tokens: int = 0
    error: str | None = None


async def one(stub: pb_grpc.LoopServeStub, item: WorkItem, cap: asyncio.Semaphore) -> Sample:
    async with cap:
        s = Sample(time.perf_counter())
        try:
            async for r in stub.Generate(request_to_proto(item.prompt, item.params, item.request_id)):
                kind = r.WhichOneof("response")
                if kind == "chunk":
                    s.first = s.first or time.perf_counter()
                    s.tokens += len(r.chunk.token_ids)
                elif kind == "error":
                    s.error = f"{r.error.code}: {r.error.message}"
        except grpc.aio.AioRpcError as e:
            s.error = f"{e.code().name}: {e.details()}"
        s.done = time.perf_counter()
        if s.error is None and s.tokens != item.params.max_tokens:
            s.error = f"{s.tokens} tokens, asked for {item.params.max_tokens}"
        return s


async def used_blocks_when_idle(stub: pb_grpc.LoopServeStub) -> dict[str, dict[str, int]]:
    """Every worker's used blocks per pool once none has work left (prefill workers free a
    handoff's blocks when the decode side's notification arrives, just after the last token)."""
    deadline = time.monotonic() + IDLE_TIMEOUT_S
    while True:
        workers = (await stub.GetStats(pb.StatsRequest())).workers
        used = {w.worker_id: {"looped": w.looped.used, "flat": w.flat.used} for w in workers}
        busy = any(w.num_waiting or w.num_running or w.num_receiving or w.num_transferring
                   for w in workers)
        if (not busy and not any(sum(u.values()) for u in used.values())) or time.monotonic() > deadline:
            return used
        await asyncio.sleep(0.2)


async def drive(server: Server, items: list[WorkItem], idle_items: list[WorkItem],
                concurrency: int) -> tuple[list[Sample], list[Sample], float, dict]:
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pb_grpc.LoopServeStub(channel)
        one_at_a_time = asyncio.Semaphore(1)
        idle = [await one(stub, it, one_at_a_time) for it in idle_items]  # also warms up
        cap = asyncio.Semaphore(concurrency)
        t0 = time.perf_counter()
        loaded = await asyncio.gather(*(one(stub, it, cap) for it in items))
        wall = time.perf_counter() - t0
        return idle, list(loaded), wall, await used_blocks_when_idle(stub)


async def serve_and_drive(cluster: Cluster, args) -> tuple[list[Sample], list[Sample], float, dict]:
    server = await Server(cluster.router, cluster.config.server).start()
    try:
        idle_items = make_workload(8, seed=args.seed + 1, max_tokens=args.max_tokens, prompt_words=(2, 6))
        items = make_workload(args.requests, seed=args.seed, max_tokens=args.max_tokens,
                              prompt_words=(2, 6))
        return await drive(server, items, idle_items, args.concurrency)
    finally:
        await server.stop()


def _ms(values: list[float], q: float) -> float:
    return 1e3 * percentile(values, q)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=1000, help="streams open at once, at most")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--model", default="tiny-ouro")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    queue = max(2 * args.requests, 4096)  # every stream fits: nothing is refused by design
    cfg = load_cluster_config({
        "mode": "pd", "launcher": "ray", "ray": {"num_cpus": 4},
        "engine": {"model": args.model, "block_size": 16, "num_blocks": 4096, "max_model_len": 256,
                   "max_num_seqs": 64, "max_waiting": queue},
        "server": {"port": 0, "max_pending_requests": queue}})
    with Cluster(cfg) as cluster:
        idle, loaded, wall, used = asyncio.run(serve_and_drive(cluster, args))

    errors = [s.error for s in loaded if s.error]
    ok = [s for s in loaded if s.error is None]
    leaked = sum(sum(u.values()) for u in used.values())
    print(f"{len(loaded)} streams, at most {args.concurrency} open at once, {args.max_tokens} tokens "
          f"each: {len(errors)} errors" + (f" (first: {errors[0]})" if errors else ""))
    if ok:
        tokens = sum(s.tokens for s in ok)
        rows = {"TTFT": ([s.first - s.start for s in ok], [s.first - s.start for s in idle]),
                "end-to-end": ([s.done - s.start for s in ok], [s.done - s.start for s in idle])}
        for name, (vals, base) in rows.items():
            print(f"{name:10s} p50 {_ms(vals, 50):8.1f} ms  p99 {_ms(vals, 99):8.1f} ms  "
                  f"(idle cluster p50 {_ms(base, 50):6.1f} ms; loaded p50 / idle {percentile(vals, 50) / percentile(base, 50):.1f}x)")
        print(f"throughput {tokens / wall:.1f} tokens/s, {len(ok) / wall:.1f} requests/s "
              f"({wall:.1f} s for the batch)")
    print("used blocks after, from GetStats: " + ", ".join(
        f"{w} looped {u['looped']} flat {u['flat']}" for w, u in sorted(used.items())))
    print("command: python " + " ".join(sys.argv))
    return 0 if not errors and leaked == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
