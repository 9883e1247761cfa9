"""Where a decode step's time goes at serving concurrency (issue 41 item 4): attention vs
GEMMs vs the rest on the GPU, and the host's share of the wall time.

C requests of P-token prompts (benchmarks/throughput.py's engine: the KV pool sized from free
memory, GPU features on; --mode fixed: the max loops, or adaptive: exit_threshold 0.6) are
added at once and stepped until every one decodes; then, after throughput.py's warm-up (every
graph size up to C) and --steps steps more, --steps steps are timed bare (wall per step,
tokens per step), and the same number again under torch.profiler: GPU-busy time per step (kernels and copies, graph replays included), its
split by kernel family, the top kernels, and each Operation's batches and rows. A second
window runs under cProfile for the host's top functions.

--closed-loop instead times throughput.py's whole cell (2×C requests, C in flight, prompts
arriving as requests end, --output-len tokens each) one engine step at a time, the device
synchronised after each, and splits the wall by the step's batch: replayed from a CUDA graph
(decode-shaped) or eager (prompt rows), per Operation. The syncs stop the host running ahead,
so steps take longer than in the table; the split says where the cell's time goes.

GPU: python benchmarks/profile_gpu.py [--cs 32,64] [--prompt-len 1024] [--steps 60]
     [--kv-cache-dtype auto|fp8_e4m3] [--mode fixed|adaptive] [--closed-loop [--output-len 128]]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import re
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import throughput  # noqa: E402  (the table's engine and workload, one definition)

from loopserve.bench.crossover import machine  # noqa: E402
from loopserve.bench.dataset import random_requests  # noqa: E402

FAMILIES = [  # first match wins; the rest is "other" (norms, activations, rotary, sampling)
    ("attention", re.compile(r"paged_attn|merge_splits|attention|flash", re.I)),
    ("kv write", re.compile(r"write_kv", re.I)),
    ("fused loop", re.compile(r"fused|ouro_loop", re.I)),
    ("gemm", re.compile(r"gemm|nvjet|cutlass|xmma|sm90|sm100|cublas|matmul|splitk", re.I)),
    ("copy/memset", re.compile(r"memcpy|memset|copy", re.I)),
]


def family(name: str) -> str:
    return next((f for f, rx in FAMILIES if rx.search(name)), "other")


def steady(engine, prompts: list[list[int]], sp, prefix: str) -> list[str]:
    """Add the requests and step until each has a token (all prefills done); their ids."""
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        engine.add_request(p, sp, request_id=rid)
    seen: set[str] = set()
    while len(seen) < len(prompts):
        for o in engine.step():
            if o.new_token_ids:
                seen.add(o.request_id)
            if o.finished:
                raise RuntimeError(f"{o.request_id} ended during the warm-up: raise --output-len")
    return ids


def sync(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)


def window(engine, steps: int) -> tuple[float, int, Counter, float]:
    """Wall seconds, output tokens, batches per Operation, and mean rows of a RECURRENT batch
    over `steps` steps."""
    b0, loops0 = Counter(engine.counters.batches), engine.counters.loops_run
    tokens = 0
    sync(engine)
    t0 = time.perf_counter()
    for _ in range(steps):
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    sync(engine)
    wall = time.perf_counter() - t0
    batches = Counter(engine.counters.batches)
    batches.subtract(b0)
    rows = (engine.counters.loops_run - loops0) / max(1, batches["RECURRENT"])
    return wall, tokens, batches, rows


def profile_c(table, prompts: list[list[int]], c: int, steps: int, mode: str) -> None:
    engine = table.engine
    sp = throughput.params(mode, table.args, table.max_loops, table.args.output_len)
    throughput.warm_up(table, prompts, c)
    ids = steady(engine, prompts[:c], sp, f"c{c}-")
    window(engine, steps)  # the decode shapes' first graph captures and kernel compiles
    wall, tokens, batches, rows = window(engine, steps)
    print(f"\n## C={c}, P={table.args.prompt_len}, {mode}: {wall / steps * 1e3:.3f} ms/step wall, {tokens / steps:.2f} "
          f"tokens/step, {tokens / wall:.1f} tok/s; batches {dict(batches)}, {rows:.1f} rows per RECURRENT",
          flush=True)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if engine.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        pwall, _, _, _ = window(engine, steps)
    cuda = engine.device.type == "cuda"
    evs = [e for e in prof.key_averages() if (e.self_device_time_total if cuda else e.self_cpu_time_total) > 0]
    if not cuda:  # the smoke run: CPU op time stands in
        for e in evs:
            e.self_device_time_total = e.self_cpu_time_total
    busy = sum(e.self_device_time_total for e in evs) / 1e3  # ms
    fam: Counter = Counter()
    for e in evs:
        fam[family(e.key)] += e.self_device_time_total / 1e3
    print(f"GPU busy {busy / steps:.3f} ms/step of {pwall / steps * 1e3:.3f} wall under the profiler "
          f"({busy / (pwall * 1e3):.0%}); bare wall {wall / steps * 1e3:.3f}")
    print("by family (ms/step, share of busy): " + ", ".join(
        f"{f} {t / steps:.3f} ({t / busy:.0%})" for f, t in fam.most_common()))
    print(f"{'kernel':<90} {'ms/step':>8} {'calls/step':>10} {'us/call':>8}")
    for e in sorted(evs, key=lambda e: -e.self_device_time_total)[:22]:
        t = e.self_device_time_total / 1e3
        print(f"{e.key[:90]:<90} {t / steps:>8.3f} {e.count / steps:>10.1f} {t * 1e3 / max(1, e.count):>8.1f}")
    cp = cProfile.Profile()
    cp.enable()
    window(engine, steps)
    cp.disable()
    buf = io.StringIO()
    pstats.Stats(cp, stream=buf).sort_stats("tottime").print_stats(16)
    print("host, cProfile by own time:\n" + "\n".join(buf.getvalue().splitlines()[4:30]), flush=True)
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def closed_loop_split(table, prompts: list[list[int]], c: int, mode: str, output_len: int) -> None:
    """The table's cell at C, each step timed with the device synchronised, its wall split by
    the kind of batch the step ran (see the module doc)."""
    engine = table.engine
    graphs = engine.runner.graphs
    throughput.warm_up(table, prompts, c)
    split: dict[tuple[str, str], list[float]] = {}
    step = engine.step

    def timed_step():
        runs0, batches0 = (graphs.runs if graphs is not None else 0), Counter(engine.counters.batches)
        sync(engine)
        t0 = time.perf_counter()
        out = step()
        sync(engine)
        ran = Counter(engine.counters.batches)
        ran.subtract(batches0)
        op = next((o for o, n in ran.items() if n > 0), "none")
        kind = "graph" if graphs is not None and graphs.runs > runs0 else ("eager" if op != "none" else "idle")
        split.setdefault((kind, op), []).append(time.perf_counter() - t0)
        return out

    engine.step = timed_step
    try:
        sp = [throughput.params(mode, table.args, table.max_loops, output_len)] * (2 * c)
        t0 = time.perf_counter()
        results, _ = throughput.closed_loop(engine, prompts[:2 * c], sp, c, float("inf"))
        wall = time.perf_counter() - t0
    finally:
        del engine.step  # the class's step again
    tokens = sum(len(r.token_ids) for r in results.values())
    print(f"\n## closed loop C={c}, P={table.args.prompt_len}, {mode}: {2 * c} requests, {tokens} tokens in "
          f"{wall:.2f} s ({tokens / wall:.1f} tok/s, steps synchronised)")
    print(f"{'batch':<20} {'steps':>6} {'ms/step':>8} {'s':>7} {'share':>6}")
    for (kind, op), ts in sorted(split.items(), key=lambda kv: -sum(kv[1])):
        print(f"{kind + ' ' + op:<20} {len(ts):>6} {sum(ts) / len(ts) * 1e3:>8.2f} {sum(ts):>7.2f} "
              f"{sum(ts) / wall:>6.0%}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cs", default="32,64")
    p.add_argument("--prompt-len", type=int, default=1024)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--mode", choices=("fixed", "adaptive"), default="fixed")
    p.add_argument("--closed-loop", action="store_true", help="time the table's cell step by step instead")
    p.add_argument("--output-len", type=int, default=128, help="--closed-loop's tokens per request")
    p.add_argument("--model", default="ouro-1.4b-shape")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cpu: a smoke run of the script (busy is then CPU op time)")
    a = p.parse_args(argv)
    cs = [int(x) for x in a.cs.split(",") if x]
    # throughput's own arguments for its Table; output long enough that no request ends in a window
    out_len = a.output_len if a.closed_loop else 4 * a.steps + 64
    args = throughput.parse_args(["--model", a.model, "--device", a.device, "--cs", a.cs, "--prompt-lens", str(a.prompt_len),
                                  "--output-len", str(out_len), "--kv-cache-dtype", a.kv_cache_dtype])
    args.prompt_len = a.prompt_len
    print("command: python", " ".join(sys.argv))
    print("machine:", machine(), flush=True)
    table = throughput.Table(args)
    cs = [c for c in cs if c <= table.holds(a.prompt_len)] or [1]
    table.start(max(cs))
    prompts = [r.prompt for r in random_requests(2 * max(cs), a.prompt_len, 1, seed=1)]
    print(f"pool {table.num_blocks} blocks; holds {table.holds(a.prompt_len)} requests; KV {a.kv_cache_dtype}")
    for c in cs:
        if a.closed_loop:
            closed_loop_split(table, prompts, c, a.mode, a.output_len)
        else:
            profile_c(table, prompts, c, a.steps, a.mode)
    return 0


if __name__ == "__main__":
    sys.exit(main())
