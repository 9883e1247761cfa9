"""Colocated vs 1P1D under one seeded Poisson load, in process (the clusters' routers, not a
server's front): the library behind benchmarks/pd_vs_colocated.py, whose docstring says what
it prints. Here, not in benchmarks/, so it is importable from an installed package and
shares `bench.workload` with the job and the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

from loopserve.bench.workload import (RequestResult, WorkItem, greedy_divergence, make_workload, run_workload,
                                      summarize)
from loopserve.cluster.cluster import Cluster, wait_idle
from loopserve.cluster.config import ClusterConfig, load_cluster_config
from loopserve.engine.config import GPU_FEATURES

# Where the modes differ, each side's logprob of the other's token tells a near-tie from a
# fault; SamplingParams allows at most 20. A token outside them counts as a fault.
TOP_LOGPROBS = 20
KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "throughput_tok_s", "goodput_req_s")


def cluster_config(mode: str, args: argparse.Namespace) -> ClusterConfig:
    """Tiny CPU engines without --config; else the YAML, its colocated worker given the
    GPUs of both PD groups so the two modes get the same hardware."""
    if args.config is None:
        engine = {"model": args.model, "block_size": 16, "num_blocks": 4096, "max_model_len": 1024,
                  "max_num_seqs": 64}
        return load_cluster_config({"mode": mode, "launcher": args.launcher, "engine": engine,
                                    "ray": {"num_cpus": 4},
                                    "transfer": {"progress_thread": bool(args.progress_thread)}})
    data = yaml.safe_load(args.config.read_text())
    if args.num_blocks is not None:
        data["engine"]["num_blocks"] = args.num_blocks
    if args.gpu_features:
        data["engine"].update(GPU_FEATURES)
    gpus = sum(data.get(r, {}).get("num_gpus", 0.0) for r in ("prefill", "decode"))
    data["colocated"] = {"num_workers": 1, "num_gpus": gpus, **data.get("colocated", {})}
    if args.progress_thread is not None:
        data.setdefault("transfer", {})["progress_thread"] = args.progress_thread
    return load_cluster_config({**data, "mode": mode})


def run_mode(mode: str, args: argparse.Namespace) -> tuple[dict, list[RequestResult], dict]:
    """(summary, results, KV read totals) of the measured run; raises if the warm-up failed.

    When measured requests failed, the idle check and the read totals are skipped: a failed
    worker may be gone, and its requests have already ended.
    """
    cfg = cluster_config(mode, args)
    with Cluster(cfg) as cluster:
        # Warm-up at the measured prompt lengths: GPU engines compile kernels and capture
        # graphs for each new batch shape on first use.
        warm = make_workload(16, seed=args.seed + 1, max_tokens=8,
                             prompt_words=(args.min_words, args.max_words))
        warm_up(cluster, warm)
        reads0 = _reads(cluster)
        items = make_workload(args.requests, seed=args.seed, max_tokens=args.max_tokens,
                              rate=args.rate, prompt_words=(args.min_words, args.max_words),
                              exit_threshold=args.exit_threshold, logprobs=TOP_LOGPROBS)
        t0 = time.perf_counter()
        results = asyncio.run(run_workload(cluster.router, items))
        summary = summarize(results, time.perf_counter() - t0, slo_tpot_s=args.slo_tpot_ms / 1e3)
        if any(r.error for r in results):
            return summary, results, {}
        wait_idle(cluster.handles)
        reads = {k: v - reads0.get(k, 0) for k, v in _reads(cluster).items()}
    return summary, results, reads


def warm_up(cluster: Cluster, items: list[WorkItem]) -> None:
    """Run `items` (first uses: kernels compiled, graphs captured, allocators filled) and wait
    until the workers are idle; raises if a request failed."""
    failed = [r for r in asyncio.run(run_workload(cluster.router, items)) if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(items)} warm-up requests failed, first: "
                           f"{failed[0].error}")
    wait_idle(cluster.handles)


def _reads(cluster: Cluster) -> dict:
    total = {"count": 0, "bytes": 0, "seconds": 0.0, "fence_seconds": 0.0}
    for h in cluster.handles:
        if h.role == "decode":
            for k in total:
                total[k] += getattr(h.stats().decode.kv_reads, k)
    return total


def plot(curves: dict[str, dict[str, list[float]]], title: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, metric in zip(axes, ("TTFT", "TPOT")):
        for mode, vals in curves.items():
            xs = sorted(1e3 * v for v in vals[metric])
            ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=mode)
        ax.set_xlabel(f"{metric} (ms)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"loopserve {title}: colocated vs 1P1D (same seeded Poisson load)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The benchmark's options (benchmarks/pd_vs_colocated.py's command line)."""
    p.add_argument("--config", type=Path, default=None, help="cluster YAML (default: tiny CPU engines)")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--rate", type=float, default=6.0, help="Poisson arrivals, requests/s")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--min-words", type=int, default=8)
    p.add_argument("--max-words", type=int, default=40)
    p.add_argument("--exit-threshold", type=float, default=None)
    p.add_argument("--model", default="tiny-ouro")
    p.add_argument("--num-blocks", type=int, default=None,
                   help="the config's engine.num_blocks instead (a smaller GPU than the config's)")
    p.add_argument("--gpu-features", action="store_true",
                   help=f"with --config: the engine's GPU paths on explicitly ({GPU_FEATURES}; the CUDA "
                        "defaults unless the config turns one off)")
    p.add_argument("--tie-nats", type=float, default=0.25,
                   help="1P1D may pick another greedy token than colocated only where the two are this close")
    p.add_argument("--launcher", choices=["process", "ray"], default="process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress-thread", action=argparse.BooleanOptionalAction, default=None,
                   help="one UCX progress thread per NIXL agent (spins a core) instead of the step loop")
    p.add_argument("--slo-tpot-ms", type=float, default=50.0, help="goodput counts requests within it")
    p.add_argument("--png", type=Path, default=Path("out/pd_latency_cdf.png"))


def report(runs: dict[str, tuple[dict, list[RequestResult], dict]], args: argparse.Namespace) -> bool:
    """Print each mode's failed requests, the table and ratios of the modes that ran, write
    the PNG; True if any request failed."""
    failed = False
    for name, (_, results, _) in runs.items():
        errors = Counter(r.error for r in results if r.error)
        if errors:
            failed = True
            print(f"{name}: {sum(errors.values())} of {len(results)} requests failed:")
            for error, n in errors.most_common():
                print(f"  {n} x {error}")
    print(f"{'mode':10s} " + " ".join(f"{k:>16s}" for k in KEYS) + f" {'ok':>6s}")
    for name, (s, _, _) in runs.items():
        print(f"{name:10s} " + " ".join(f"{s.get(k, float('nan')):16.2f}" for k in KEYS)
              + f" {s['ok']:>3d}/{s['requests']}")
    if {"colocated", "1P1D"} <= runs.keys():
        base, pd = runs["colocated"][0], runs["1P1D"][0]
        print("ratios 1P1D / colocated: " + ", ".join(f"{k} {_ratio(pd, base, k)}" for k in KEYS))
    reads = runs["1P1D"][2] if "1P1D" in runs else {}
    if reads.get("count"):
        gbs = reads["bytes"] / reads["seconds"] / 1e9 if reads["seconds"] else float("nan")
        print(f"KV transfer (NIXL READ): {reads['count']} reads, "
              f"{reads['bytes'] / reads['count'] / 1024:.1f} KiB/read, "
              f"{1e3 * reads['seconds'] / reads['count']:.2f} ms/read (post to seen done), {gbs:.3f} GB/s; "
              f"before each post, {1e3 * reads['fence_seconds'] / reads['count']:.2f} ms until the "
              f"device had zeroed the blocks (the step thread does not wait)")
    print(f"goodput: requests/s finishing with TPOT <= {args.slo_tpot_ms:g} ms")
    if runs:
        curves = {name: {"TTFT": [r.ttft for r in results if not r.error and r.ttft is not None],
                         "TPOT": [r.tpot for r in results if not r.error and r.tpot is not None]}
                  for name, (_, results, _) in runs.items()}
        plot(curves, args.config.stem if args.config else "CPU", args.png)
        print(f"latency CDF: {args.png}")
    if {"colocated", "1P1D"} <= runs.keys():
        failed |= not same_greedy_tokens(runs["colocated"][1], runs["1P1D"][1], args.tie_nats)
    print("command: python " + " ".join(sys.argv))
    return failed


def same_greedy_tokens(base: list[RequestResult], other: list[RequestResult], tie_nats: float,
                       names: tuple[str, str] = ("colocated", "1P1D")) -> bool:
    """Disaggregation (or caching, or routing) must not change a greedy token, but for
    near-ties that low-precision arithmetic in differently shaped batches can flip: prints the
    comparison of `names` (base, other), True if no stream differs beyond `tie_nats`."""
    theirs = {r.request_id: r for r in other}
    ties, bad = [], []
    for r in base:
        d = greedy_divergence(r, theirs[r.request_id])
        if d is not None:
            (ties if d[1] <= tie_nats else bad).append((r.request_id, *d))
    print(f"greedy tokens: {names[1]} equals {names[0]} for {len(base) - len(ties) - len(bad)}/{len(base)} requests; "
          f"{len(ties)} part at a near-tie (<= {tie_nats:g} nats"
          + (f", largest {max(t[2] for t in ties):.3f}" if ties else "") + f"); {len(bad)} differ beyond"
          + (f" (first: {bad[0][0]} at token {bad[0][1]}, gap {bad[0][2]:.3f})" if bad else ""))
    return not bad


def _ratio(num: dict, den: dict, key: str) -> str:
    """num/den of one metric; n/a where a mode has none of it or it is 0 (no goodput)."""
    a, b = num.get(key), den.get(key)
    return "n/a" if a is None or not b else f"{a / b:.2f}x"


def compare(args: argparse.Namespace) -> int:
    """Run both modes (a mode that cannot run is reported, the other still runs), print the
    report; the exit status: 1 if a mode failed, a request failed or greedy tokens differ."""
    runs = {}
    for mode, name in (("colocated", "colocated"), ("pd", "1P1D")):
        try:
            runs[name] = run_mode(mode, args)
        except Exception as e:  # noqa: BLE001 - a mode that cannot run is reported, the other still runs
            print(f"{name}: failed: {type(e).__name__}: {e}")
    requests_failed = report(runs, args)
    return 1 if requests_failed or len(runs) < 2 else 0


