"""`loopserve bench serve`: drive a running server's HTTP (default) or gRPC front with a seeded
workload, Poisson arrivals at --request-rate or all at once, capped by --max-concurrency;
print the report, write it as JSON and the latency CDFs as PNG."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import time
from pathlib import Path

from loopserve.bench.backends import Backend, GrpcBackend, OpenAIBackend, RequestTrace
from loopserve.bench.dataset import BenchRequest, arrival_offsets, random_requests
from loopserve.bench.report import plot_cdfs, summarize, table, write_json

# Where results go by default: relative to the working directory, and ignored by git (.gitignore)
# so that a run in the checkout leaves no untracked files.
RESULTS_DIR = Path("results")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=("openai", "grpc"), default="openai", help="the front to drive")
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="the HTTP front (openai)")
    p.add_argument("--address", default="127.0.0.1:50051", help="the gRPC front (grpc)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's /v1/models; openai)")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens (mean)")
    p.add_argument("--output-len", type=int, default=32, help="output tokens (mean; ignore_eos)")
    p.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths uniform in [len*(1-r), len*(1+r)]")
    p.add_argument("--prefix-len", type=int, default=0, help="a random prefix every prompt shares")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals, requests/s; inf: all at once")
    p.add_argument("--max-concurrency", type=int, default=None,
                   help="requests in flight at most (default: no cap)")
    p.add_argument("--seed", type=int, default=0, help="the workload's lengths, tokens and arrivals")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--min-loops", type=int, default=None, help="per request (default: the model's)")
    p.add_argument("--max-loops", type=int, default=None, help="per request (default: the model's)")
    p.add_argument("--exit-threshold", type=float, default=None,
                   help="per request; 1.0: fixed depth (default: the model's)")
    p.add_argument("--goodput", nargs="*", default=[], metavar="KEY:MS",
                   help="SLOs for goodput, e.g. ttft:500 tpot:50")
    p.add_argument("--result-file", type=Path, default=RESULTS_DIR / "bench-result.json",
                   help="the report as JSON, per request too (its directory is created)")
    p.add_argument("--plot", default=str(RESULTS_DIR / "bench-latency.png"),
                   help="latency CDFs (PNG); '' for none")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _slos(items: list[str]) -> dict[str, float]:
    slos = {}
    for item in items:
        key, _, ms = item.partition(":")
        if key not in ("ttft", "tpot") or not ms.replace(".", "", 1).isdigit():
            raise ValueError(f"--goodput {item!r}: expected ttft:MS or tpot:MS")
        slos[key] = float(ms)
    return slos


async def _server_model(base_url: str, token: str | None) -> str:
    import aiohttp

    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession(headers=headers) as s, s.get(base_url.rstrip("/") + "/v1/models") as r:
        if r.status != 200:
            raise ValueError(f"{base_url}/v1/models answered HTTP {r.status}: {(await r.text())[:200]}")
        return (await r.json())["data"][0]["id"]


async def _backend(args: argparse.Namespace, token: str | None) -> Backend:
    extra = {k: v for k in ("temperature", "min_loops", "max_loops", "exit_threshold")
             if (v := getattr(args, k)) is not None}
    if args.backend == "grpc":
        return GrpcBackend(args.address, token, extra)
    model = args.model or await _server_model(args.base_url, token)
    return OpenAIBackend(args.base_url, model, token, extra)


async def run(backend: Backend, requests: list[BenchRequest], offsets: list[float],
              max_concurrency: int | None, progress: bool) -> tuple[list[RequestTrace], float]:
    from tqdm import tqdm

    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    bar = tqdm(total=len(requests), disable=not progress, unit="req")
    start = time.perf_counter()

    async def one(req: BenchRequest, offset: float) -> RequestTrace:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with limit:
            trace = await backend.send(req)
        bar.update(1)
        return trace

    try:
        traces = await asyncio.gather(*(one(r, t) for r, t in zip(requests, offsets)))
    finally:
        bar.close()
        await backend.close()
    return traces, time.perf_counter() - start


def _writable(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def bench_serve(args: argparse.Namespace) -> int:
    from loopserve.cluster.config import AUTH_TOKEN_ENV

    slos = _slos(args.goodput)
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                               args.prefix_len, args.seed)
    offsets = arrival_offsets(len(requests), args.request_rate, args.seed)

    async def main() -> tuple[list[RequestTrace], float]:
        backend = await _backend(args, os.environ.get(AUTH_TOKEN_ENV))
        return await run(backend, requests, offsets, args.max_concurrency, not args.no_progress)

    traces, duration = asyncio.run(main())
    result = {"backend": args.backend, "target": args.base_url if args.backend == "openai" else args.address,
              "num_prompts": args.num_prompts,
              "request_rate": None if math.isinf(args.request_rate) else args.request_rate,
              "max_concurrency": args.max_concurrency, "seed": args.seed,
              **summarize(traces, duration, slos)}
    print(table(result))
    write_json(result, traces, _writable(args.result_file))
    print(f"result: {args.result_file.resolve()}")
    if args.plot:
        plot = _writable(Path(args.plot))
        plot_cdfs(traces, plot, f"{args.backend} {result['target']}: {args.num_prompts} requests, "
                  f"rate {args.request_rate}")
        print(f"latency CDFs: {plot.resolve()}")
    return 0 if result["failed"] == 0 else 1
