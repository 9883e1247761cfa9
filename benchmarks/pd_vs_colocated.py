"""Colocated vs 1P1D: TTFT / TPOT p50 and p99, throughput and goodput at a TPOT SLO, under
one seeded Poisson load.

Both clusters run the same workload (same prompts, same arrival times) in the same run;
1P1D moves every prompt's KV with a real NIXL READ, whose GB/s is reported from the decode
worker's own timing (READ started -> completion seen). Prints a table, the 1P1D /
colocated ratios and the command, and writes a PNG of the latency CDFs.

Without --config: tiny CPU engines. With a cluster YAML (e.g. configs/h200-1p1d.yaml, a
prefill and a decode process sharing one GPU), its engine and worker groups are used for
1P1D and the colocated worker gets the GPUs of both groups.

Usage: python benchmarks/pd_vs_colocated.py [--config YAML] [--requests 48] [--rate 6]
       [--max-tokens 32] [--model tiny-ouro] [--launcher process|ray] [--slo-tpot-ms 50]
       [--png out/pd_latency_cdf.png]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import yaml

from loopserve.cluster.cluster import Cluster, wait_idle
from loopserve.cluster.config import load_cluster_config
from loopserve.cluster.workload import make_workload, run_workload, summarize


def cluster_config(mode: str, args):
    if args.config is None:
        engine = {"model": args.model, "block_size": 16, "num_blocks": 4096, "max_model_len": 1024,
                  "max_num_seqs": 64}
        return load_cluster_config({"mode": mode, "launcher": args.launcher, "engine": engine,
                                    "ray": {"num_cpus": 4},
                                    "transfer": {"progress_thread": bool(args.progress_thread)}})
    data = yaml.safe_load(args.config.read_text())
    if args.num_blocks is not None:
        data["engine"]["num_blocks"] = args.num_blocks
    gpus = sum(data.get(r, {}).get("num_gpus", 0.0) for r in ("prefill", "decode"))
    data["colocated"] = {"num_workers": 1, "num_gpus": gpus, **data.get("colocated", {})}
    if args.progress_thread is not None:
        data.setdefault("transfer", {})["progress_thread"] = args.progress_thread
    return load_cluster_config({**data, "mode": mode})


def run_mode(mode: str, args) -> tuple[dict, list, dict]:
    cfg = cluster_config(mode, args)
    with Cluster(cfg) as cluster:
        # Warm-up at the measured prompt lengths: GPU engines compile kernels and capture
        # graphs for each new batch shape on first use.
        warm = make_workload(16, seed=args.seed + 1, max_tokens=8,
                             prompt_words=(args.min_words, args.max_words))
        asyncio.run(run_workload(cluster.router, warm))
        wait_idle(cluster.handles)
        reads0 = _reads(cluster)
        items = make_workload(args.requests, seed=args.seed, max_tokens=args.max_tokens,
                              rate=args.rate, prompt_words=(args.min_words, args.max_words),
                              exit_threshold=args.exit_threshold)
        t0 = time.perf_counter()
        results = asyncio.run(run_workload(cluster.router, items))
        summary = summarize(results, time.perf_counter() - t0, slo_tpot_s=args.slo_tpot_ms / 1e3)
        errors = [r.error for r in results if r.error]
        if errors:
            raise SystemExit(f"{mode}: {len(errors)} requests failed, first: {errors[0]}")
        wait_idle(cluster.handles)
        reads = {k: v - reads0.get(k, 0) for k, v in _reads(cluster).items()}
    return summary, results, reads


def _reads(cluster) -> dict:
    total = {"count": 0, "bytes": 0, "seconds": 0.0}
    for h in cluster.handles:
        if h.role == "decode":
            for k in total:
                total[k] += h.stats()["kv_reads"][k]
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


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    p.add_argument("--launcher", choices=["process", "ray"], default="process")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--progress-thread", action=argparse.BooleanOptionalAction, default=None,
                   help="one UCX progress thread per NIXL agent (spins a core) instead of the step loop")
    p.add_argument("--slo-tpot-ms", type=float, default=50.0, help="goodput counts requests within it")
    p.add_argument("--png", type=Path, default=Path("out/pd_latency_cdf.png"))
    args = p.parse_args()
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")

    rows, curves, tokens = {}, {}, {}
    for mode, name in (("colocated", "colocated"), ("pd", "1P1D")):
        summary, results, reads = run_mode(mode, args)
        rows[name] = (summary, reads)
        tokens[name] = {r.request_id: r.token_ids for r in results}
        curves[name] = {"TTFT": [r.ttft for r in results if r.ttft is not None],
                        "TPOT": [r.tpot for r in results if r.tpot is not None]}

    keys = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "throughput_tok_s",
            "goodput_req_s")
    print(f"{'mode':10s} " + " ".join(f"{k:>16s}" for k in keys) + f" {'ok':>6s}")
    for name, (s, _) in rows.items():
        print(f"{name:10s} " + " ".join(f"{s.get(k, float('nan')):16.2f}" for k in keys)
              + f" {s['ok']:>3d}/{s['requests']}")
    base, pd = rows["colocated"][0], rows["1P1D"][0]
    print("ratios 1P1D / colocated: " + ", ".join(f"{k} {pd[k] / base[k]:.2f}x" for k in keys))
    reads = rows["1P1D"][1]
    if reads["count"]:
        gbs = reads["bytes"] / reads["seconds"] / 1e9 if reads["seconds"] else float("nan")
        print(f"KV transfer (NIXL READ): {reads['count']} reads, "
              f"{reads['bytes'] / reads['count'] / 1024:.1f} KiB/read, "
              f"{1e3 * reads['seconds'] / reads['count']:.2f} ms/read, {gbs:.3f} GB/s")
    print(f"goodput: requests/s finishing with TPOT <= {args.slo_tpot_ms:g} ms")
    plot(curves, args.config.stem if args.config else "CPU", args.png)
    print(f"latency CDF: {args.png}")
    # Greedy requests: disaggregation must not change a token.
    differ = [rid for rid, toks in tokens["colocated"].items() if tokens["1P1D"].get(rid) != toks]
    print(f"greedy tokens: 1P1D equals colocated for {len(tokens['colocated']) - len(differ)}/"
          f"{len(tokens['colocated'])} requests" + (f" (first differing: {differ[0]})" if differ else ""))
    print("command: python " + " ".join(sys.argv))
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
