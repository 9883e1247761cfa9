"""Single-GPU benchmarks (H200): each measures its own baseline in the same run and prints ratios.

1. decode step time per token at batch 1/8/64/256 vs the weight-read bound
   (weight bytes read per token / torch device-to-device copy bandwidth measured here);
2. prefill of 8k tokens: achieved TFLOP/s vs torch bf16 matmul TFLOP/s measured here;
3. continuous-depth (refill) vs fixed-cohort (no_refill) tokens/s at adaptive exit;
4. NIXL KV READ between two processes on the one GPU vs torch D2D copy of the same bytes.

Usage: python benchmarks/gpu_h200.py [--parts 1,2,3,4,p] [--decode-batches 1,8,64,256] [--sync-readback]
       [--model ouro-1.4b-shape] [--out DIR]
(--sync-readback: part 1 also runs each graph mode with defer_readback off, the baseline of
the deferred sample read-back.)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import random
import statistics
import sys
import time
import traceback

import torch

from loopserve.bench.rates import device_time, measure_rates, prefill_flops, weight_bytes_per_token
from loopserve.engine.config import GPU_FEATURES, GPU_PATHS_OFF, EngineConfig
from loopserve.engine.engine_core import EngineCore
from loopserve.model.registry import resolve_model
from loopserve.protocol.sampling_params import SamplingParams


def engine(model, name: str, **kw) -> EngineCore:
    cfg = dict(model=name, device="cuda", dtype="bfloat16", block_size=16, num_blocks=4096,
               max_model_len=9216, max_num_seqs=256, max_num_batched_tokens=16384, **GPU_FEATURES)
    cfg.update(kw)
    return EngineCore(EngineConfig(**cfg), model=model)


DECODE_MODES = {"eager": GPU_PATHS_OFF,
                "graphs": {**GPU_FEATURES, "fused_loop": "off"},
                "fused": {**GPU_FEATURES, "fused_loop": "on", "fused_loop_rows": 8}}


def part_decode(model, name: str, base: dict, batches: tuple[int, ...] = (1, 8, 64, 256),
                sync_readback: bool = False) -> dict:
    """Eager launches, CUDA-graph replays of the per-layer kernels and (batches the fused loop
    takes) graphs of the fused loop kernel, each vs the weight-read bound; `sync_readback`:
    the graph modes again with each sample read before the next PRELUDE is launched."""
    out = {}
    bound = weight_bytes_per_token(model) / (base["copy_GBps"] * 1e9)
    modes = dict(DECODE_MODES)
    if sync_readback:
        modes.update({f"{m}-sync": {**DECODE_MODES[m], "defer_readback": False} for m in ("graphs", "fused")})
    for batch in batches:
        for mode, kw in modes.items():
            if mode.startswith("fused") and batch > DECODE_MODES["fused"]["fused_loop_rows"]:
                continue
            e = engine(model, name, num_blocks=batch * 4 * (288 // 16) + 64, max_model_len=288, **kw)
            rng = random.Random(0)
            for i in range(batch):
                e.add_request([rng.randrange(1000, 40000) for _ in range(256)],
                              SamplingParams(max_tokens=24, ignore_eos=True, exit_threshold=1.0))
            times: dict[str, list[float]] = {}
            while e.has_unfinished():
                for o in e.step():
                    times.setdefault(o.request_id, []).extend(o.token_times)
            torch.cuda.synchronize()
            per_tok = statistics.median((ts[-1] - ts[4]) / (len(ts) - 5) for ts in times.values())
            out[f"{batch}-{mode}"] = {"token_s": per_tok, "bound_s": bound, "ratio": per_tok / bound}
            print(f"[decode] batch {batch:3d} {mode:6s}: {per_tok * 1e3:7.2f} ms/token; weight-read "
                  f"bound {bound * 1e3:.2f} ms -> {per_tok / bound:.2f}x", flush=True)
            del e
            torch.cuda.empty_cache()
        speedup = out[f"{batch}-eager"]["token_s"] / out[f"{batch}-graphs"]["token_s"]
        print(f"[decode] batch {batch:3d}: graphs {speedup:.1f}x faster than eager", flush=True)
        if f"{batch}-fused" in out:
            speedup = out[f"{batch}-graphs"]["token_s"] / out[f"{batch}-fused"]["token_s"]
            print(f"[decode] batch {batch:3d}: fused loop {speedup:.2f}x faster than per-layer graphs", flush=True)
        for mode in ("graphs", "fused"):
            if f"{batch}-{mode}-sync" in out:
                speedup = out[f"{batch}-{mode}-sync"]["token_s"] / out[f"{batch}-{mode}"]["token_s"]
                print(f"[decode] batch {batch:3d} {mode}: deferred read-back {speedup:.2f}x faster than "
                      f"reading each sample first", flush=True)
    return out


def part_prefill(model, name: str, base: dict) -> dict:
    n = 8192
    e = engine(model, name, num_blocks=(n + 32) // 16 * 4 + 16, max_num_batched_tokens=n)
    prompt = [random.Random(1).randrange(1000, 40000) for _ in range(n)]
    times = []
    for _ in range(4):  # the first is a warm-up; best of the other three
        e.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True, exit_threshold=1.0))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while e.has_unfinished():
            e.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    dt = min(times[1:])
    tf = prefill_flops(model, n) / dt / 1e12
    r = {"seconds": dt, "TFLOPs": tf, "matmul_TFLOPs": base["matmul_TFLOPs"], "ratio": tf / base["matmul_TFLOPs"]}
    print(f"[prefill] 8192 tokens x {model.max_loops} loops: {dt * 1e3:.1f} ms, {tf:.0f} TFLOP/s = "
          f"{r['ratio'] * 100:.0f}% of matmul {base['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    return r


def part_refill(model, name: str) -> dict:
    res = {}
    for policy in ("no_refill", "refill"):
        e = engine(model, name, policy=policy, num_blocks=128 * 4 * 12 + 64, max_model_len=192,
                   max_num_seqs=128)
        for timed in (False, True):  # the untimed pass captures this policy's CUDA graphs
            rng = random.Random(2)
            for _ in range(128):
                e.add_request([rng.randrange(1000, 40000) for _ in range(rng.randint(32, 128))],
                              SamplingParams(max_tokens=48, ignore_eos=True, exit_threshold=0.6))
            torch.cuda.synchronize()
            t0, toks = time.perf_counter(), 0
            while e.has_unfinished():
                toks += sum(len(o.new_token_ids) for o in e.step())
            torch.cuda.synchronize()
        res[policy] = toks / (time.perf_counter() - t0)
        c = e.counters
        print(f"[refill] {policy:9s}: {res[policy]:8.1f} tok/s  (both passes: batches={c.batches} loops={c.loops_run})", flush=True)
    res["ratio"] = res["refill"] / res["no_refill"]
    print(f"[refill] refill / no_refill = {res['ratio']:.2f}x", flush=True)
    return res


def _nixl_owner(conn, shape, block_size, share: bool = False):
    import torch.multiprocessing  # noqa: F401 - registers the CUDA-IPC pickling of tensors

    from loopserve.kv_transfer.nixl_agent import NixlKVWorker

    pool = torch.randn(shape, dtype=torch.bfloat16, device="cuda")
    w = NixlKVWorker("gpu-prefill", {"looped": pool}, block_size, {"m": 1})
    conn.send(w.handshake_info())
    if share:  # the same pool through a plain CUDA-IPC mapping, for the diagnostic copy
        conn.send(pool)
    conn.recv()
    w.close()


def _wall_copy_s(dst: torch.Tensor, src: torch.Tensor, reps: int = 5) -> float:
    """Best-of-reps host wall time of one copy, post to the host knowing it is done: the
    same clock as a NIXL READ's post-to-poll (CUDA events would leave out the launch)."""
    best = float("inf")
    for _ in range(reps + 1):  # the first is a warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return best


def part_nixl(base: dict) -> dict:
    from loopserve.kv_transfer.nixl_agent import NixlKVWorker

    # Ouro-1.4B's KV block: 24 layers x K/V x 16 tokens x 16 heads x 128 dims (bf16) = 3 MiB;
    # 2048 blocks = an 8k-token prompt's KV on its 4 loop planes (6 GiB)
    shape = (2048, 24, 2, 16, 16, 128)
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=_nixl_owner, args=(b, shape, 16, True))
    p.start()
    import torch.multiprocessing  # noqa: F401 - unpickles the owner's pool as a CUDA-IPC mapping

    info = a.recv()
    remote = a.recv()
    local = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    w = NixlKVWorker("gpu-decode", {"looped": local}, 16, {"m": 1}, capture_telemetry=True)
    w.add_peer(info)
    res = {}
    for count in (1, 16, 128, 512, 2048):
        ids = list(range(count))
        table = {"flat": [], "depth": [ids]}
        best = float("inf")
        for rep in range(5):
            t0 = time.perf_counter()
            w.start_read(f"r{count}-{rep}", "gpu-prefill", table, table, count * 16)
            while True:
                done, failed = w.poll()
                if done or failed:
                    break
            best = min(best, time.perf_counter() - t0)
            assert not failed
        nbytes = count * local[0].numel() * 2
        src = torch.empty_like(local[:count])
        tc = device_time(lambda: src.copy_(local[:count]), local.device)
        tw = _wall_copy_s(src, local[:count])
        t_ipc = _wall_copy_s(src, remote[:count])  # torch's copy of the peer's blocks, same mapping kind
        del src
        torch.cuda.empty_cache()
        r = res[count] = {"nixl_GBps": nbytes / best / 1e9, "copy_GBps": nbytes / tw / 1e9,
                          "copy_stream_GBps": nbytes / tc / 1e9, "ipc_copy_GBps": nbytes / t_ipc / 1e9}
        r["ratio"], r["ratio_stream"] = r["nixl_GBps"] / r["copy_GBps"], r["nixl_GBps"] / r["copy_stream_GBps"]
        descs = w.read_stats[f"r{count}-4"].descriptors
        print(f"[nixl] {count:4d} blocks ({nbytes / 2**20:.0f} MiB): NIXL READ {r['nixl_GBps']:.1f} GB/s vs one "
              f"D2D copy {r['copy_GBps']:.1f} GB/s (wall, post to done) -> {r['ratio']:.2f}x; vs back-to-back "
              f"copies {r['copy_stream_GBps']:.1f} GB/s (CUDA events) -> {r['ratio_stream']:.2f}x "
              f"({descs} descriptors); torch copy from the peer's pool through CUDA IPC "
              f"{r['ipc_copy_GBps']:.1f} GB/s", flush=True)
    del remote
    a.send("stop")
    p.join(timeout=30)
    w.close()
    return res


def _kernel_table(prof, rows: int = 18) -> str:
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=rows, max_name_column_width=60)


def part_profile(model, name: str) -> dict:
    """Where batch-1 decode and 8k prefill time goes: host phases (cProfile) and GPU kernels
    (torch.profiler), per token / per prefill, with GPU-busy vs wall time."""
    import cProfile
    import io
    import pstats

    from torch.profiler import ProfilerActivity, profile

    e = engine(model, name, num_blocks=4 * 24 + 64, max_model_len=384)
    e.add_request(list(range(1000, 1256)), SamplingParams(max_tokens=100, ignore_eos=True, exit_threshold=1.0))
    for _ in range(60):
        e.step()
    torch.cuda.synchronize()
    steps = 60  # 10 tokens: PRELUDE + 4 RECURRENT + CODA each
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        e.step()
    torch.cuda.synchronize()
    prof.disable()
    wall = time.perf_counter() - t0
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("cumulative").print_stats(30)
    print(f"[profile] decode b1 graphs: {wall / steps * 6e3:.2f} ms/token (cProfile on)", flush=True)
    print(buf.getvalue()[:7000], flush=True)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tp:
        t0 = time.perf_counter()
        for _ in range(steps):
            e.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    evs = [ev for ev in tp.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(ev.device_time for ev in evs) / 1e3  # ms, kernels + copies
    print(f"[profile] decode b1 graphs: wall {wall / steps * 6e3:.2f} ms/token, GPU busy "
          f"{busy / steps * 6:.2f} ms/token, {len(evs) / steps * 6:.0f} device ops/token", flush=True)
    print(_kernel_table(tp), flush=True)
    del e
    torch.cuda.empty_cache()
    n = 8192
    e = engine(model, name, num_blocks=(n + 32) // 16 * 4 + 16, max_num_batched_tokens=n)
    prompt = [random.Random(1).randrange(1000, 40000) for _ in range(n)]
    for run in range(2):
        e.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True, exit_threshold=1.0))
        with profile(activities=[ProfilerActivity.CUDA]) as tp:
            while e.has_unfinished():
                e.step()
            torch.cuda.synchronize()
    evs = [ev for ev in tp.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    print(f"[profile] prefill 8k: GPU busy {sum(ev.device_time for ev in evs) / 1e3:.1f} ms", flush=True)
    print(_kernel_table(tp, 22), flush=True)
    return {}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="1,2,3,4")
    ap.add_argument("--model", default="ouro-1.4b-shape")
    ap.add_argument("--out", default=None)
    ap.add_argument("--decode-batches", default="1,8,64,256", help="part 1's batch sizes")
    ap.add_argument("--sync-readback", action="store_true", help="part 1 also with defer_readback off")
    args = ap.parse_args()
    parts = set(args.parts.split(","))
    torch.manual_seed(0)
    base = measure_rates(torch.device("cuda"), torch.bfloat16)
    print(f"[baseline] D2D copy {base['copy_GBps']:.0f} GB/s (read+write); bf16 matmul "
          f"{base['matmul_TFLOPs']:.0f} TFLOP/s", flush=True)
    results = {"baseline": base, "command": "python " + " ".join(sys.argv)}
    model = resolve_model(args.model, dtype=torch.bfloat16, device="cuda", seed=0) if parts & {"1", "2", "3", "p"} else None
    for key, fn in (("1", lambda: part_decode(model, args.model, base,
                                              tuple(int(b) for b in args.decode_batches.split(",")),
                                              args.sync_readback)),
                    ("2", lambda: part_prefill(model, args.model, base)),
                    ("3", lambda: part_refill(model, args.model)),
                    ("4", lambda: part_nixl(base)),
                    ("p", lambda: part_profile(model, args.model))):
        if key in parts:
            try:
                results[key] = fn()
            except Exception as e:  # noqa: BLE001 - report and go on to the next part
                traceback.print_exc()
                results[key] = {"error": repr(e)}
    print("command: " + results["command"])
    if args.out:
        with open(f"{args.out}/gpu_h200.json", "w") as f:
            json.dump(results, f, indent=2, default=str)
    failed = [k for k, r in results.items() if isinstance(r, dict) and "error" in r]
    if failed:
        print(f"failed parts: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
