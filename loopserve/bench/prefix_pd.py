"""Prefix caching, prefix-aware routing and per-request disaggregation on a 2P2D cluster, on
vs off under one seeded Poisson load: the library behind benchmarks/prefix_pd.py, whose
docstring says what it prints.

Each arm starts its own cluster (same engines, same workload, same arrival times), so no
arm inherits another's cache; the warm-up uses prefixes the measured workload never sends.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import dataclass

from loopserve.bench.pd_compare import TOP_LOGPROBS, same_greedy_tokens, warm_up
from loopserve.bench.workload import RequestResult, WorkItem, run_workload, summarize
from loopserve.cluster.cluster import Cluster, wait_idle
from loopserve.cluster.config import ClusterConfig, load_cluster_config
from loopserve.protocol.sampling_params import SamplingParams

KEYS = ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "throughput_tok_s")
PROMPT_VOCAB = 256  # token ids below it: valid for every model's vocabulary
# CPU fp32: a cached prefix or another batch shape may flip an exact tie between two tokens,
# never more.
TIE_NATS = 1e-3


@dataclass(frozen=True)
class Arm:
    """One configuration of the three features."""

    name: str
    prefix_caching: bool
    prefix_routing: bool
    local_prefill_tokens: int


@dataclass
class ArmRun:
    summary: dict
    results: list[RequestResult]
    counters: dict[str, float]  # prefix-cache tokens, KV read bytes, requests prefilled locally


def shared_prefix_workload(n: int, rate: float, seed: int, num_prefixes: int, prefix_len: int,
                           turn_len: tuple[int, int], max_tokens: int) -> list[WorkItem]:
    """`num_prefixes` system prompts of `prefix_len` tokens; each request one of them (uniform)
    plus a user turn of `turn_len` tokens; Poisson arrivals at `rate` req/s."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(PROMPT_VOCAB) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    prompts = [rng.choice(prefixes) + [rng.randrange(PROMPT_VOCAB) for _ in range(rng.randint(*turn_len))]
               for _ in range(n)]
    return _items(prompts, rate, rng, max_tokens, f"sp{seed}")


def short_workload(n: int, rate: float, seed: int, prompt_len: tuple[int, int],
                   max_tokens: int) -> list[WorkItem]:
    """Unrelated prompts of `prompt_len` tokens: nothing to cache, only the route to choose."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(PROMPT_VOCAB) for _ in range(rng.randint(*prompt_len))] for _ in range(n)]
    return _items(prompts, rate, rng, max_tokens, f"sh{seed}")


def _items(prompts: list[list[int]], rate: float, rng: random.Random, max_tokens: int,
           tag: str) -> list[WorkItem]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS)
    t, items = 0.0, []
    for i, prompt in enumerate(prompts):
        items.append(WorkItem(f"{tag}-{i}", prompt, params, t))
        t += rng.expovariate(rate)
    return items


def cluster_config(arm: Arm, args: argparse.Namespace) -> ClusterConfig:
    engine = {"model": args.model, "block_size": 16, "num_blocks": args.num_blocks,
              "max_model_len": 2048, "max_num_seqs": 64, "enable_prefix_caching": arm.prefix_caching}
    return load_cluster_config({
        "mode": "pd", "launcher": "process", "engine": engine,
        "prefill": {"num_workers": args.prefill_workers}, "decode": {"num_workers": args.decode_workers},
        "server": {"routing": {"policy": "prefix_aware" if arm.prefix_routing else "least_loaded"}, "local_prefill_tokens": arm.local_prefill_tokens}})


def run_arm(arm: Arm, warm: list[WorkItem], items: list[WorkItem], args: argparse.Namespace) -> ArmRun:
    """A warm-up on other prefixes, then the measured run on a fresh cluster."""
    with Cluster(cluster_config(arm, args)) as cluster:
        warm_up(cluster, warm)
        before = _counters(cluster)
        t0 = time.perf_counter()
        results = asyncio.run(run_workload(cluster.router, items))
        summary = summarize(results, time.perf_counter() - t0)
        if not any(r.error for r in results):
            wait_idle(cluster.handles)
        after = _counters(cluster)
    return ArmRun(summary, results, {k: after[k] - before[k] for k in after})


def _counters(cluster: Cluster) -> dict[str, float]:
    out = {"prefix_queries": 0.0, "prefix_hits": 0.0, "read_bytes": 0.0}
    for h in cluster.handles:
        s = h.stats()
        out["prefix_queries"] += s.engine.prefix_cache.queries
        out["prefix_hits"] += s.engine.prefix_cache.hits
        if s.decode is not None:
            out["read_bytes"] += s.decode.kv_reads.bytes
    registry = cluster.router.metrics.registry
    for where in ("local", "remote"):
        out[f"prefill_{where}"] = registry.get_sample_value(
            "loopserve:requests_routed_total", {"prefill": where}) or 0.0
    return out


def print_table(title: str, runs: dict[str, ArmRun], base: str) -> bool:
    """The workload's table, the ratios against `base`, failed requests and the greedy-token
    check; True if a request failed or a stream differs beyond a near-tie."""
    print(f"\n{title}")
    print(f"{'arm':14s} " + " ".join(f"{k:>16s}" for k in KEYS)
          + f" {'ok':>8s} {'cached %':>9s} {'KV read MiB':>12s} {'local/remote':>13s}")
    bad = False
    for name, run in runs.items():
        s, c = run.summary, run.counters
        hit = 100 * c["prefix_hits"] / c["prefix_queries"] if c["prefix_queries"] else 0.0
        print(f"{name:14s} " + " ".join(f"{s.get(k, float('nan')):16.2f}" for k in KEYS)
              + f" {s['ok']:>4d}/{s['requests']:<3d} {hit:9.1f} {c['read_bytes'] / 2**20:12.1f}"
              + f" {int(c['prefill_local']):>6d}/{int(c['prefill_remote']):<6d}")
        errors = sorted({r.error for r in run.results if r.error})
        if errors:
            bad = True
            print(f"  {name}: {s['requests'] - s['ok']} requests failed, first: {errors[0]}")
    for name, run in runs.items():
        if name != base:
            print(f"ratios {name} / {base}: " + ", ".join(
                f"{k} {run.summary[k] / runs[base].summary[k]:.2f}x" for k in KEYS
                if runs[base].summary.get(k) and k in run.summary))
            bad |= not same_greedy_tokens(runs[base].results, run.results, TIE_NATS, (base, name))
    return bad


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-ouro")
    p.add_argument("--prefill-workers", type=int, default=2)
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--requests", type=int, default=160)
    p.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals, requests/s")
    p.add_argument("--prefixes", type=int, default=16)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--turn-len", type=int, nargs=2, default=(50, 200), metavar=("MIN", "MAX"))
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--short-requests", type=int, default=120)
    p.add_argument("--short-rate", type=float, default=4.0)
    p.add_argument("--short-len", type=int, nargs=2, default=(5, 40), metavar=("MIN", "MAX"))
    p.add_argument("--local-prefill-tokens", type=int, default=64,
                   help="the threshold of the arms with per-request disaggregation on")
    p.add_argument("--workloads", nargs="*", choices=("shared-prefix", "short"),
                   default=["shared-prefix", "short"])
    p.add_argument("--sweep", type=int, nargs="*", default=[], metavar="N",
                   help="after the workloads, the short workload with prompts of exactly N tokens, "
                        "remote vs local, for each N: where local prefill stops paying")
    p.add_argument("--seed", type=int, default=0)


def main(args: argparse.Namespace) -> int:
    """The workloads, then the sweep, each arm on a fresh cluster; exit status 1 if an arm could not run, a
    request failed or greedy tokens differ between arms."""
    local = args.local_prefill_tokens
    plans = []
    if "shared-prefix" in args.workloads:
        plans.append((
            f"shared prefix: {args.requests} requests at {args.rate:g}/s, {args.prefixes} prefixes x "
            f"{args.prefix_len} + {args.turn_len[0]}-{args.turn_len[1]} tokens, "
            f"{args.prefill_workers}P{args.decode_workers}D",
            (Arm("off", False, False, 0), Arm("cache+route", True, True, 0),
             Arm(f"all(local<{local})", True, True, local)),
            shared_prefix_workload(args.requests, args.rate, args.seed, args.prefixes, args.prefix_len,
                                   tuple(args.turn_len), args.max_tokens),
            shared_prefix_workload(8, float("inf"), args.seed + 1000, 2, args.prefix_len,
                                   tuple(args.turn_len), 4)))
    lengths = [tuple(args.short_len)] if "short" in args.workloads else []
    for lo, hi in lengths + [(n, n) for n in args.sweep]:
        threshold = local if (lo, hi) == tuple(args.short_len) else hi + 1
        plans.append((
            f"short prompts: {args.short_requests} requests at {args.short_rate:g}/s, {lo}-{hi} tokens, "
            f"{args.prefill_workers}P{args.decode_workers}D",
            (Arm("remote", True, True, 0), Arm(f"local<{threshold}", True, True, threshold)),
            short_workload(args.short_requests, args.short_rate, args.seed, (lo, hi), args.max_tokens),
            short_workload(8, float("inf"), args.seed + 1000, (lo, hi), 4)))
    bad = False
    for title, arms, items, warm in plans:
        runs: dict[str, ArmRun] = {}
        for arm in arms:
            try:
                runs[arm.name] = run_arm(arm, warm, items, args)
            except Exception as e:  # noqa: BLE001 - an arm that cannot run is reported, the rest still run
                bad = True
                print(f"{title}: {arm.name}: failed: {type(e).__name__}: {e}")
        if arms[0].name in runs:
            bad |= print_table(title, runs, arms[0].name)
    print("cached %: prompt tokens found in a prefix cache / looked up (all workers); local/remote: "
          "requests prefilled on their decode worker / on a prefill worker")
    print("command: python " + " ".join(sys.argv))
    return 1 if bad else 0
