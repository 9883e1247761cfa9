"""Serving-concurrency throughput against the hardware floor (issue 41 item 3): vllm-rlt's
single-GPU table with the engine driven directly, and (--server-c) the same workload through
`loopserve serve` + its HTTP front, measured in one run.

Workload of a cell (prompt length P, exit mode, concurrency C): 2*C requests of P random token
ids (loopserve.bench.dataset, below 256: valid for every vocabulary) and --output-len output
tokens (ignore_eos), in closed loop with C in flight (the next request is added as one ends),
prefill and drain included, timed from the first add to the last token. Exit modes: `fixed`
(every token runs the model's max loops) and `adaptive` (exit_threshold --exit-threshold,
default 0.6, up to the max loops). Prefix caching is off (cells reuse the prompts; each
prefills them). One engine of the model for the whole table: its KV pool
sized from the memory free after the weights (less --reserve-gib for activations and graphs),
GPU features on (EngineConfig's GPU_FEATURES) on CUDA, --kv-cache-dtype passed through.

Columns:
  tok/s:      output tokens / the cell's wall time;
  floor:      the cell's time at the hardware rates measured in this run (loopserve.bench.rates):
              every prompt's prefill FLOPs at the matmul rate, plus at the copy rate the weights
              once per loop for every C decode tokens and every decode token's context K/V on
              the planes it runs (fixed: the max loops; adaptive: the cell's mean exit depth,
              prefill included);
  of floor:   floor time / wall time (1.0 = at the floor);
  tok/step:   output tokens / engine steps (Operations batches), and against lockstep
              C / (mean depth + 2) (PRELUDE, the loops, CODA);
  full:       the same ratio over only the steps taken while all C requests were in flight
              (the batch width apart from the closed loop's fill and drain);
  pool holds: requests of P + output tokens the KV pool holds at once; a C above it does
              not fit and is printed so (not run);
  s:          the cell's wall time (with --max-seconds a cell is cut there, and said so; past
              --budget-s of the whole run no further cell starts, and each prints as skipped).
Before each cell an untimed warm-up compiles kernels and captures graphs at every batch size
the cell can meet (adaptive exit meets them all as rows leave at different depths): k requests
of 2 tokens at fixed depth for C, then each graph size k below C (largest first: see
`warm_sizes`). The note says how many graphs the timed part still captured and how many of its
batches ran eagerly (prompt rows: not decode-shaped, so no graph). Correctness in the same
run: the first --check requests run alone (C = 1) with their top-20 logprobs, and again inside
every cell; the largest C that ran them to the end must give the same greedy tokens, but at
near-ties up to --tie-nats (each run's logprob of its own token minus that of the other's;
default 0.25 nats in bf16/fp16, 0.001 in fp32), as benchmarks/pd_vs_colocated.py rules. With
adaptive exit a first difference where the two runs exited the token at different depths is an
"exit flip", listed apart: bf16 numerics that depend on the batch's shape move the exit gate's
score, a decision near the threshold goes the other way, and the token comes from another
depth's state. Exit status 1 if a stream differs beyond the tie at equal depths, or (fp32) at
an exit flip, or if an engine failed: a cell whose engine fails (out of memory, a kernel
fault) prints FAILED with the error and the table goes on with a fresh engine.

GPU:  python benchmarks/throughput.py [--cs 1,8,32,64,128,256] [--prompt-lens 1024,4096]
      [--output-len 128] [--modes fixed,adaptive] [--kv-cache-dtype auto|fp8_e4m3]
      [--max-seconds 60] [--budget-s S] [--server-c 64] [--json out/throughput.json]
CPU smoke: python benchmarks/throughput.py --device cpu --model tiny-ouro --dtype float32
      --cs 1,4 --prompt-lens 32 --output-len 8
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import yaml

from loopserve.bench.crossover import machine
from loopserve.bench.dataset import BenchRequest, random_requests
from loopserve.bench.rates import measure_rates, prefill_flops, weight_bytes_per_token
from loopserve.bench.workload import RequestResult, greedy_divergence
from loopserve.engine.config import GPU_FEATURES, EngineConfig
from loopserve.engine.engine_core import EngineCore
from loopserve.intmath import cdiv
from loopserve.model.registry import resolve_model
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.scheduler.policy import POLICIES

TOP_LOGPROBS = 20  # the most SamplingParams allows: a near-tie's gap needs the other token in it
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Cell:
    prompt_len: int
    mode: str
    c: int
    pool_holds: int
    fits: bool
    skipped: bool = False  # not run: the table was past --budget-s
    requests: int = 0  # finished within the cell
    cut: bool = False  # stopped at --max-seconds
    wall_s: float = 0.0
    warmup_s: float = 0.0
    output_tokens: int = 0
    tok_s: float = 0.0
    floor_s: float = 0.0
    of_floor: float = 0.0
    steps: int = 0
    tok_per_step: float = 0.0
    full_of_lockstep: float = 0.0  # tok/step ÷ lockstep over the steps with all C in flight
    mean_depth: float = 0.0
    of_lockstep: float = 0.0
    error: str | None = None  # the engine failed in this cell (the table goes on with a fresh one)
    captures: int = 0  # CUDA graphs recorded in the timed part (shapes the warm-up did not meet)
    eager: int = 0  # batches of the timed part not replayed from a graph (prompt rows: run eagerly)


class Table:
    """The engine, its pool, and what the floor charges per token (from the engine itself)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.device = torch.device(args.device)
        dtype = DTYPES[args.dtype]
        self.model = resolve_model(args.model, dtype=dtype, device=self.device, seed=0)
        self.kwargs = dict(model=args.model, device=args.device, dtype=args.dtype, block_size=args.block_size,
                           max_model_len=max(args.prompt_lens) + args.output_len,
                           max_num_batched_tokens=args.max_num_batched_tokens,
                           policy=args.policy, split_prefill=args.split_prefill or args.policy == "mixed",
                           enable_prefix_caching=False,  # cells reuse prompts: each must prefill them
                           async_scheduling=args.async_scheduling,
                           **(GPU_FEATURES if self.device.type == "cuda" else {}),
                           **({"kv_cache_dtype": args.kv_cache_dtype} if args.kv_cache_dtype != "auto" else {}))
        probe = EngineCore(EngineConfig(**self.kwargs, num_blocks=4, max_num_seqs=1), model=self.model)
        kv = probe.runner.kv
        self.planes = self.model.kv_planes(probe.max_loops)
        self.max_loops = probe.max_loops
        # K/V bytes of one token on one looped plane, and on the flat pool
        self.kv_token = kv.looped[0].nbytes / args.block_size
        self.flat_token = kv.flat[0].nbytes / args.block_size if kv.flat is not None else 0.0
        block = kv.looped[0].nbytes + (kv.flat[0].nbytes / self.max_loops if kv.flat is not None else 0)
        del probe, kv
        self.num_blocks = args.num_blocks or self._size_pool(block)
        self.engine: EngineCore | None = None

    def _size_pool(self, block_bytes: float) -> int:
        """From the memory free now less the reserve (CUDA), or enough for the largest C (CPU)."""
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            free = torch.cuda.mem_get_info(self.device)[0] - int(self.args.reserve_gib * 2**30)
            return max(1, int(free // block_bytes))
        need = cdiv(max(self.args.prompt_lens) + self.args.output_len, self.args.block_size)
        return max(self.args.cs) * need * self.planes + self.planes

    def holds(self, prompt_len: int) -> int:
        """Requests of `prompt_len` + output tokens the pool holds at once."""
        need = cdiv(prompt_len + self.args.output_len, self.args.block_size)
        flat = self.num_blocks // self.max_loops + 1
        fit = self.num_blocks // (need * self.planes)
        return min(fit, flat // need) if self.flat_token else fit

    def cell(self, prompt_len: int, mode: str, c: int, skipped: bool = False) -> Cell:
        """A cell's row before it runs: how many requests the pool holds, whether C fits."""
        holds = self.holds(prompt_len)
        return Cell(prompt_len, mode, c, holds, c <= holds, skipped=skipped)

    def start(self, max_c: int) -> EngineCore:
        self.max_c = max(1, max_c)
        self.engine = EngineCore(EngineConfig(**self.kwargs, num_blocks=self.num_blocks,
                                              max_num_seqs=self.max_c), model=self.model)
        return self.engine

    def stop(self) -> None:
        """Shut the engine down and give its pool and graphs' memory back."""
        self.engine.shutdown()
        self.engine = None
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def restart(self) -> EngineCore:
        """A fresh engine after one failed."""
        self.stop()
        return self.start(self.max_c)

    def floor_s(self, rates: dict, prompt_len: int, c: int, outputs: list[int], depth: float) -> float:
        """The cell's time at the measured rates (see the module doc)."""
        prefill = len(outputs) * prefill_flops(self.model, prompt_len, depth) / (rates["matmul_TFLOPs"] * 1e12)
        decode_tokens = sum(max(0, n - 1) for n in outputs)
        weights = decode_tokens / c * weight_bytes_per_token(self.model, depth)
        # token i (1-based) after the prompt attends over prompt_len + i positions
        ctx = sum((n - 1) * prompt_len + n * (n - 1) / 2 for n in outputs if n > 1)
        kv = ctx * (self.kv_token * depth + self.flat_token)
        return prefill + (weights + kv) / (rates["copy_GBps"] * 1e9)


def params(mode: str, args: argparse.Namespace, max_loops: int, max_tokens: int,
           logprobs: bool = False) -> SamplingParams:
    loops = {"min_loops": max_loops, "max_loops": max_loops} if mode == "fixed" else \
        {"exit_threshold": args.exit_threshold}
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS if logprobs else None,
                          **loops)


@dataclass
class FullWidth:
    """Engine steps (batches) taken while all C requests were in flight, and the output
    tokens they gave: the width apart from the closed loop's fill and drain."""
    steps: int = 0
    tokens: int = 0


def closed_loop(engine: EngineCore, prompts: list[list[int]], sp: list[SamplingParams], c: int,
                deadline: float, full: FullWidth | None = None) -> tuple[dict[str, RequestResult], bool]:
    """Run the requests with `c` in flight until all end, or abort the rest at `deadline`."""
    results: dict[str, RequestResult] = {}
    order = [f"r{i}" for i in range(len(prompts))]
    nxt, live, cut = 0, set(), False
    while nxt < len(order) or live:
        while nxt < len(order) and len(live) < c:
            rid = order[nxt]
            engine.add_request(prompts[nxt], sp[nxt], request_id=rid)
            results[rid] = RequestResult(rid)
            live.add(rid)
            nxt += 1
        at_width = full is not None and len(live) == c
        batches0 = sum(engine.counters.batches.values()) if at_width else 0
        outputs = engine.step()
        if at_width:
            full.steps += sum(engine.counters.batches.values()) - batches0
            full.tokens += sum(len(o.new_token_ids) for o in outputs)
        for o in outputs:
            r = results[o.request_id]
            r.token_ids.extend(o.new_token_ids)
            r.exit_depths.extend(o.exit_depths)
            r.top_logprobs.extend(dict(top) for top in o.top_logprobs or ())
            if o.finished:
                r.finish_reason, r.error = o.finish_reason, o.error
                live.discard(o.request_id)
        if time.perf_counter() > deadline and live:
            for rid in list(live):
                engine.abort(rid)
            while engine.has_unfinished():
                engine.step()
            live.clear()
            cut, nxt = True, len(order)
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    failed = [r for r in results.values() if r.error]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0].error}")
    return results, cut


def warm_sizes(table: Table, c: int) -> list[int]:
    """C, then the engine's graph sizes below it, largest first (none without graphs):
    adaptive exit meets them all as rows leave at different depths, and so does a closed
    loop's drain. Largest first: C prompts in flight grow the state slab to the cell's peak
    (every prompt row's loop state), and a growth drops every graph captured before it."""
    graphs = table.engine.runner.graphs
    return [c] + sorted((s for s in (graphs.sizes if graphs is not None else ()) if s < c), reverse=True)


def warm_up(table: Table, prompts: list[list[int]], c: int) -> None:
    """Compile kernels and capture graphs at every batch size up to C: k requests of 2 tokens
    at fixed depth for each of `warm_sizes`."""
    for k in warm_sizes(table, c):
        closed_loop(table.engine, prompts[:k], [params("fixed", table.args, table.max_loops, 2)] * k, k, math.inf)


def run_cell(table: Table, rates: dict, prompts: list[list[int]], prompt_len: int, mode: str, c: int,
             check: int) -> tuple[Cell, dict[str, RequestResult]]:
    args, engine = table.args, table.engine
    cell = table.cell(prompt_len, mode, c)
    if not cell.fits:
        return cell, {}
    t0 = time.perf_counter()
    warm_up(table, prompts, c)
    cell.warmup_s = time.perf_counter() - t0
    n = 2 * c
    sp = [params(mode, args, table.max_loops, args.output_len, logprobs=i < check) for i in range(n)]
    batches0 = sum(engine.counters.batches.values())
    graphs = engine.runner.graphs
    captures0 = graphs.captures if graphs is not None else 0
    runs0 = graphs.runs if graphs is not None else 0
    full = FullWidth()
    t0 = time.perf_counter()
    results, cell.cut = closed_loop(engine, prompts[:n], sp, c, t0 + args.max_seconds, full)
    cell.wall_s = time.perf_counter() - t0
    cell.captures = graphs.captures - captures0 if graphs is not None else 0
    done = [r for r in results.values() if r.finish_reason == "length"]
    outputs = [len(r.token_ids) for r in results.values()]
    depths = [d for r in results.values() for d in r.exit_depths]
    cell.requests, cell.output_tokens = len(done), sum(outputs)
    cell.mean_depth = sum(depths) / len(depths) if depths else 0.0
    cell.steps = sum(engine.counters.batches.values()) - batches0
    cell.eager = cell.steps - (graphs.runs - runs0) if graphs is not None else 0
    cell.tok_s = cell.output_tokens / cell.wall_s
    cell.floor_s = table.floor_s(rates, prompt_len, c, outputs, cell.mean_depth)
    cell.of_floor = cell.floor_s / cell.wall_s
    cell.tok_per_step = cell.output_tokens / max(1, cell.steps)
    lockstep = c / (cell.mean_depth + 2) if cell.mean_depth else 0.0
    cell.of_lockstep = cell.tok_per_step / lockstep if lockstep else 0.0
    cell.full_of_lockstep = full.tokens / full.steps / lockstep if lockstep and full.steps else 0.0
    return cell, results


def compare(ref: dict[str, RequestResult], got: dict[str, RequestResult], tie_nats: float) -> dict:
    """The check requests' greedy tokens at C = 1 vs in a wide cell (pd_compare's near-tie
    rule). A first difference beyond the tie where the two runs exited that token at different
    depths is an exit flip, listed apart: the token comes from another depth's state, so its
    logprob gap says nothing about the tie (see the module doc)."""
    equal, ties, flips, bad = 0, [], [], []
    for rid, r in ref.items():
        d = greedy_divergence(r, got[rid])
        if d is None:
            equal += 1
            continue
        i, gap = d
        entry = {"request": rid, "token": i, "gap_nats": gap}
        depths = [x.exit_depths[i] if i < len(x.exit_depths) else None for x in (r, got[rid])]
        if gap <= tie_nats:
            ties.append(entry)
        elif None not in depths and depths[0] != depths[1]:
            flips.append({**entry, "depths": depths})
        else:
            bad.append(entry)
    return {"equal": equal, "near_ties": ties, "exit_flips": flips, "beyond": bad, "of": len(ref)}


HEADER = (f"{'P':>5} {'mode':>8} {'C':>4} {'tok/s':>9} {'floor s':>8} {'of floor':>8} {'tok/step':>8} "
          f"{'lockstep':>8} {'full':>5} {'depth':>5} {'holds':>5} {'s':>6}  note")


def fmt(c: Cell) -> str:
    if c.error is not None:
        return f"{c.prompt_len:>5} {c.mode:>8} {c.c:>4}  FAILED: {c.error}"
    if not c.fits:
        return f"{c.prompt_len:>5} {c.mode:>8} {c.c:>4}  does not fit: the pool holds {c.pool_holds} requests"
    if c.skipped:
        return f"{c.prompt_len:>5} {c.mode:>8} {c.c:>4}  skipped: the table is past --budget-s"
    note = f"cut at --max-seconds after {c.requests}/{2 * c.c} requests; " if c.cut else ""
    note += f"{c.captures} graph captures; " if c.captures else ""
    note += f"{c.eager} of {c.steps} batches eager; " if c.eager else ""
    return (f"{c.prompt_len:>5} {c.mode:>8} {c.c:>4} {c.tok_s:>9.1f} {c.floor_s:>8.3f} {c.of_floor:>8.2f} "
            f"{c.tok_per_step:>8.2f} {c.of_lockstep:>8.2f} {c.full_of_lockstep:>5.2f} {c.mean_depth:>5.2f} "
            f"{c.pool_holds:>5} "
            f"{c.wall_s:>6.1f}  {note}(warm-up {c.warmup_s:.1f} s)")


# ---------------------------------------------------------------------- the served arm
def serve_config(table: Table, max_c: int) -> dict:
    """`loopserve serve`'s cluster YAML for the same engine: one colocated worker as a plain
    process (no Ray on the GPU machines), any free ports."""
    gpus = 1 if table.device.type == "cuda" else 0
    return {"mode": "colocated", "launcher": "process",
            "engine": {**table.kwargs, "num_blocks": table.num_blocks, "max_num_seqs": max_c},
            "colocated": {"num_workers": 1, "num_gpus": gpus, "num_cpus": table.args.threads},
            "server": {"host": "127.0.0.1", "port": 0, "http_port": 0}}


def start_server(config: dict, workdir: Path, timeout_s: float = 600) -> tuple[subprocess.Popen, str, Path]:
    """`loopserve serve` in its own process; its HTTP URL once it prints that it serves."""
    cfg, log = workdir / "throughput_serve.yaml", workdir / "throughput_serve.log"
    cfg.write_text(yaml.safe_dump(config))
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "loopserve.cli", "serve", "--config", str(cfg)],
                                cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT, text=True)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        for line in log.read_text().splitlines():
            if line.startswith("loopserve serving"):
                return proc, line.rsplit(" on ", 1)[1].strip().removesuffix("/v1"), log
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"loopserve serve did not come up (log {log}):\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def served_tok_s(url: str, model: str, prompts: list[list[int]], extra: dict, c: int, output_len: int,
                 warm_sizes: list[int]) -> dict:
    """`loopserve bench serve`'s client (streamed /v1/completions), 2*C requests, C in flight,
    after the engine-only cell's warm-up: k requests of 2 tokens for each k in `warm_sizes`."""
    from loopserve.bench.backends import OpenAIBackend
    from loopserve.bench.report import summarize
    from loopserve.bench.serve import run

    async def go(reqs: list[BenchRequest], in_flight: int = c):
        return await run(OpenAIBackend(url, model, None, extra), reqs, [0.0] * len(reqs), in_flight, False)

    for k in warm_sizes:
        asyncio.run(go([BenchRequest(p, 2) for p in prompts[:k]], k))
    traces, duration = asyncio.run(go([BenchRequest(p, output_len) for p in prompts[:2 * c]]))
    s = summarize(traces, duration, {})
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} served requests failed: {s['errors']}")
    return {"tok_s": s["output_throughput"], "wall_s": duration, "output_tokens": s["total_output_tokens"]}


# ---------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p.add_argument("--model", default="ouro-1.4b-shape")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto (the model's dtype) or fp8_e4m3")
    p.add_argument("--cs", type=ints, default=[1, 8, 32, 64, 128, 256], help="concurrencies, comma separated")
    p.add_argument("--prompt-lens", type=ints, default=[1024, 4096])
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--modes", default="fixed,adaptive")
    p.add_argument("--exit-threshold", type=float, default=0.6, help="the adaptive mode's")
    p.add_argument("--max-seconds", type=float, default=60.0, help="cut a cell after this long")
    p.add_argument("--budget-s", type=float, default=math.inf,
                   help="start no cell after this many seconds of the run (the rest print as skipped)")
    p.add_argument("--check", type=int, default=4, help="requests whose greedy tokens are checked")
    p.add_argument("--tie-nats", type=float, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None, help="default: sized from free memory")
    p.add_argument("--reserve-gib", type=float, default=6.0, help="GPU memory left beside the KV pool")
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--policy", choices=sorted(POLICIES), default="refill",
                   help="the scheduler policy (mixed turns split prefill on)")
    p.add_argument("--split-prefill", action="store_true")
    p.add_argument("--async-scheduling", action="store_true",
                   help="EngineConfig.async_scheduling: the next batch is scheduled while one runs")
    p.add_argument("--server-c", type=int, default=0,
                   help="also serve the first prompt length's fixed-depth cell at this C through `loopserve serve`")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU: torch threads here and the served worker's num_cpus (more thrash a shared CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    args.modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in args.modes if m not in ("fixed", "adaptive")]:
        p.error(f"--modes: unknown {bad}; use fixed and/or adaptive")
    for name in ("cs", "prompt_lens"):
        if not getattr(args, name) or min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')} must list integers >= 1")
    if args.output_len < 2:
        p.error("--output-len must be >= 2 (one token comes from the prefill)")
    if args.kv_cache_dtype != "auto" and "kv_cache_dtype" not in EngineConfig.model_fields:
        p.error(f"--kv-cache-dtype {args.kv_cache_dtype}: EngineConfig has no kv_cache_dtype field at this "
                "commit (the FP8 KV cache of issue 42 is not merged); use auto")
    if args.tie_nats is None:
        args.tie_nats = 1e-3 if args.dtype == "float32" else 0.25
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    command = " ".join(["python", *sys.argv]) if argv is None else " ".join(["python benchmarks/throughput.py", *argv])
    print("command:", command)
    print("machine:", machine(), flush=True)
    t_start = time.perf_counter()
    if not args.device.startswith("cuda"):
        torch.set_num_threads(args.threads)
    table = Table(args)
    rates = measure_rates(table.device, DTYPES[args.dtype])
    print(f"rates (this run): copy {rates['copy_GBps']:.1f} GB/s (read + write), matmul "
          f"{rates['matmul_TFLOPs']:.2f} TFLOP/s ({args.dtype})")
    print(f"engine: {args.model} {args.dtype}, KV {args.kv_cache_dtype}: {table.kv_token * table.planes / 1024:.1f} KiB "
          f"per token ({table.planes} looped planes), pool {table.num_blocks} blocks of {args.block_size}; "
          f"{'GPU features on' if table.device.type == 'cuda' else 'CPU defaults'}; adaptive: exit_threshold "
          f"{args.exit_threshold}; {args.output_len} output tokens; closed loop of 2*C, C in flight", flush=True)
    fit = [c for c in args.cs if any(c <= table.holds(p) for p in args.prompt_lens)]
    table.start(max(fit, default=1))
    prompts = {p: [r.prompt for r in random_requests(2 * max(args.cs), p, 1, seed=args.seed + p)]
               for p in args.prompt_lens}
    cells, checks, failed = [], {}, False
    print(HEADER, flush=True)
    for p in args.prompt_lens:
        for mode in args.modes:
            if time.perf_counter() - t_start > args.budget_s:
                cells += [table.cell(p, mode, c, skipped=True) for c in args.cs]
                print("\n".join(fmt(c) for c in cells[-len(args.cs):]), flush=True)
                continue
            try:
                ref, _ = closed_loop(table.engine, prompts[p][:args.check],
                                     [params(mode, args, table.max_loops, args.output_len, True)] * args.check, 1,
                                     math.inf)
            except Exception as e:  # noqa: BLE001 - the engine failed: say so, go on with a fresh one
                ref, failed = {}, True
                print(f"{p:>5} {mode:>8}    1  FAILED (the C = 1 reference): {type(e).__name__}: {e}", flush=True)
                table.restart()
            widest = None
            for c in args.cs:
                if time.perf_counter() - t_start > args.budget_s:
                    cell, results = table.cell(p, mode, c, skipped=True), {}
                else:
                    try:
                        cell, results = run_cell(table, rates, prompts[p], p, mode, c, args.check)
                    except Exception as e:  # noqa: BLE001 - as above: the cell fails, the table goes on
                        cell, results, failed = table.cell(p, mode, c), {}, True
                        cell.error = f"{type(e).__name__}: {e}"
                        table.restart()
                cells.append(cell)
                print(fmt(cell), flush=True)
                if ref and all(rid in results and results[rid].finish_reason == "length" for rid in ref):
                    widest = (c, results)
            if widest is not None:
                chk = compare(ref, {rid: widest[1][rid] for rid in ref}, args.tie_nats)
                checks[f"{p}/{mode}"] = {"c": widest[0], **chk}
                failed |= bool(chk["beyond"]) or (bool(chk["exit_flips"]) and args.dtype == "float32")
                print(f"greedy tokens, P={p} {mode}: C={widest[0]} equals C=1 for {chk['equal']}/{chk['of']}; "
                      f"{len(chk['near_ties'])} part at a near-tie (<= {args.tie_nats:g} nats); "
                      f"{len(chk['exit_flips'])} part at an exit flip" + (f": {chk['exit_flips']}" if chk["exit_flips"] else "")
                      + f"; {len(chk['beyond'])} differ beyond" + (f": {chk['beyond']}" if chk["beyond"] else ""),
                      flush=True)
    served = None
    if args.server_c:
        served = serve_arm(args, table, rates, prompts, cells)
    wall = time.perf_counter() - t_start
    print(f"wall time {wall:.1f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": command, "machine": machine(), "rates": rates, "model": args.model, "dtype": args.dtype,
            "kv_cache_dtype": args.kv_cache_dtype, "exit_threshold": args.exit_threshold,
            "output_len": args.output_len, "num_blocks": table.num_blocks,
            "kv_bytes_per_token": table.kv_token * table.planes + table.flat_token,
            "cells": [asdict(c) for c in cells], "checks": checks, "served": served, "wall_s": wall}, indent=2) + "\n")
    return 1 if failed else 0


def serve_arm(args: argparse.Namespace, table: Table, rates: dict, prompts: dict, cells: list[Cell]) -> dict:
    """The first prompt length's fixed-depth cell at --server-c, engine only (from the table if
    it ran) and through `loopserve serve`; the engine's memory is freed for the server first."""
    p, c, mode = args.prompt_lens[0], args.server_c, "fixed"
    base = next((x for x in cells if (x.prompt_len, x.mode, x.c) == (p, mode, c) and x.tok_s and not x.cut), None)
    if base is None:
        table.stop()  # its pool's memory first: the new engine's pool is as large
        table.start(c)
        base, _ = run_cell(table, rates, prompts[p], p, mode, c, 0)
        print(fmt(base), flush=True)
    if not base.fits:
        print(f"served arm: C={c} does not fit at P={p}")
        return {"c": c, "fits": False}
    config = serve_config(table, c)
    sizes = warm_sizes(table, c)
    table.model = None  # the engine holds the last reference: stop() frees the weights too
    table.stop()
    if table.device.type == "cuda":
        print(f"GPU memory free for the server: {torch.cuda.mem_get_info(table.device)[0] / 2**30:.1f} GiB "
              f"(its KV pool: {table.num_blocks} blocks, as here)", flush=True)
    workdir = args.json.parent if args.json is not None else Path(tempfile.mkdtemp(prefix="throughput-"))
    workdir.mkdir(parents=True, exist_ok=True)
    proc, url, log = start_server(config, workdir)
    try:
        # Greedy, as the engine-only cell (SamplingParams' default): the OpenAI API's default
        # temperature is 1, whose per-row draws the engine-only cell never pays.
        same = {"temperature": 0.0, "min_loops": table.max_loops, "max_loops": table.max_loops}
        s = served_tok_s(url, args.model, prompts[p], same, c, args.output_len, sizes)
    finally:
        stop_server(proc)
    ratio = s["tok_s"] / base.tok_s
    print(f"served (loopserve serve, HTTP, colocated plain process): P={p} {mode} C={c}: {s['tok_s']:.1f} tok/s "
          f"in {s['wall_s']:.1f} s vs engine only {base.tok_s:.1f} -> {ratio:.2f}x (goal >= 0.9); server log {log}",
          flush=True)
    return {"c": c, "prompt_len": p, "mode": mode, **s, "engine_tok_s": base.tok_s, "ratio": ratio}


if __name__ == "__main__":
    sys.exit(main())
