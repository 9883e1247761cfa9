"""`python -m loopserve.job --config X`: start a cluster, serve or run a workload, exit.

Under `ray job submit --working-dir . -- python -m loopserve.job --config X` the
driver joins the job's cluster (RAY_ADDRESS); elsewhere it starts its own local one. The
workload run prints one JSON summary line and exits non-zero if any request failed or any
worker still holds KV blocks afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time

from loopserve.bench.workload import make_workload, run_workload, summarize
from loopserve.cli_format import HelpFormatter
from loopserve.cluster.cluster import Cluster, wait_idle
from loopserve.cluster.config import add_server_args, load_cluster_config, server_overrides
from loopserve.entrypoints.serve import serve_forever


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loopserve.job", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--config", default=None, help="cluster YAML (default: the embedded cpu-1p1d)")
    p.add_argument("--serve", action="store_true", help="serve (gRPC and OpenAI-compatible HTTP) "
                   "instead of running a workload")
    p.add_argument("--duration", type=float, default=None, help="serve this many seconds, then exit")
    add_server_args(p)
    p.add_argument("--workload", type=int, default=8, help="number of requests to run")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens per workload request")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrival rate (req/s); default all at once")
    p.add_argument("--seed", type=int, default=0, help="the workload's prompts and arrivals")
    return p


def run_job(args: argparse.Namespace) -> int:
    config = server_overrides(load_cluster_config(args.config), args)
    with Cluster(config) as cluster:
        if args.serve:
            asyncio.run(serve_forever(cluster.router, config, args.duration))
            return 0
        items = make_workload(args.workload, seed=args.seed, max_tokens=args.max_tokens, rate=args.rate)
        t0 = time.perf_counter()
        results = asyncio.run(run_workload(cluster.router, items))
        summary = summarize(results, time.perf_counter() - t0)
        summary["kv_after"] = wait_idle(cluster.handles)
        summary["mode"] = config.mode
        summary["workers"] = [h.worker_id for h in cluster.handles]
        summary["errors"] = [r.error for r in results if r.error]
        print(json.dumps(summary), flush=True)
        return 0 if summary["ok"] == len(results) else 1


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    args = build_parser().parse_args(argv)
    try:
        return run_job(args)
    except ValueError as e:  # bad config or placement: the message names it
        for line in str(e).splitlines():  # one problem per line
            print(f"loopserve job: error: {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
