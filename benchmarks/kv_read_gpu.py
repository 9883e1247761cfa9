"""A handoff's NIXL KV READ vs a device-to-device copy of the same bytes, and the wait before
the READ (issue 42 item 2), measured in one run.

Two real engines of the cluster config in two processes, as in serving: a prefill-role engine
(spawned; loopserve/bench/crossover.py's PrefillProcess) prefills a prompt of --prompt-tokens
fresh ids and hands it off; the decode-role engine here (GPU features on where the config is
on CUDA) takes it with `add_handoff` and its NIXL agent READs every plane of the prompt's
blocks. Per handoff, on one clock:
  fence: `add_handoff`, which gives and zeroes the blocks and waits for the device's compute
    stream up to that zeroing (a READ posted earlier would race it);
  READ:  start_read to poll() reporting it done, polled in a tight loop (the worker's loop
    sees it at its next tick instead: not in this figure).
Two arms: `idle` (the decode engine has nothing else to do) and `backlog` (--backlog requests
decoding, the host a few Operations ahead of the GPU, as with deferred read-back and CUDA
graphs in serving). The baseline is torch's `copy_` of the same number of bytes on the same
device, wall time from the call to the host knowing it is done (the READ's clock), and
back-to-back copies timed by CUDA events. Medians of --reps after one warm-up each.

On CPU (configs/cpu-1p1d.yaml) the same run is a smoke test: NIXL over UCX tcp,cma, the copy
a memcpy.

Usage: python benchmarks/kv_read_gpu.py [--config configs/h200-1p1d.yaml] [--prompt-tokens 1040]
       [--reps 5] [--backlog 16] [--num-blocks N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch

from loopserve.bench.crossover import (
    HANDOFF_TOKENS,
    HandoffRead,
    PrefillProcess,
    describe_engine,
    handoff_read,
    load_config,
    machine,
    random_prompt,
    worker_threads,
)
from loopserve.engine.config import GPU_FEATURES, EngineConfig
from loopserve.engine.engine_core import EngineCore
from loopserve.kv_transfer.nixl_agent import NixlKVWorker
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.worker_host.transfer_host import kv_pools

GOAL = 0.8  # READ bandwidth / copy bandwidth
BACKLOG_PROMPT, BACKLOG_TOKENS = 128, 384  # each backlog request's prompt and output tokens
STEPS_AHEAD = 6  # Operations the host launches before each handoff (a token at 4 loops)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_baseline(nbytes: int, device: torch.device, reps: int) -> dict:
    """torch copy_ of `nbytes`: median wall time post to done, and back-to-back on the stream."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    walls = []
    for i in range(reps + 1):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        if i:
            walls.append(time.perf_counter() - t0)
    out = {"wall_s": statistics.median(walls)}
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            dst.copy_(src)
        b.record()
        torch.cuda.synchronize(device)
        out["stream_s"] = a.elapsed_time(b) / 1e3 / reps
    if not torch.equal(dst, src):
        raise RuntimeError("the baseline copy did not copy")
    return out


def decode_config(cluster) -> EngineConfig:
    """The decode side as serving runs it: GPU features on where the config is on CUDA."""
    cfg = cluster.engine_config("decode")
    if cfg.device.startswith("cuda"):
        cfg = EngineConfig(**{**cfg.model_dump(), **GPU_FEATURES})
    return cfg


def check_pool(d: EngineCore, args: argparse.Namespace) -> None:
    """The backlog's and one handoff's blocks must fit the decode pool together."""
    planes = d.model.kv_planes(d.max_loops)
    need = (args.backlog * d.kv_manager.blocks_needed(BACKLOG_PROMPT + BACKLOG_TOKENS, planes)[0]
            + d.kv_manager.blocks_needed(args.prompt_tokens + HANDOFF_TOKENS, planes)[0])
    if need > d.layout.num_blocks:
        raise SystemExit(f"--backlog {args.backlog} ({BACKLOG_PROMPT}+{BACKLOG_TOKENS} tokens each) and a "
                         f"{args.prompt_tokens}-token handoff need {need} KV blocks; the pool has "
                         f"{d.layout.num_blocks} (--num-blocks raises it, or lower --backlog)")


def start_backlog(d: EngineCore, n: int, rng: random.Random) -> list[str]:
    """`n` requests decoding (every prompt prefilled, graphs captured) to keep the device busy."""
    loops = d.max_loops
    params = SamplingParams(max_tokens=BACKLOG_TOKENS, ignore_eos=True, min_loops=loops, max_loops=loops)
    rids = [d.add_request(random_prompt(rng, d, BACKLOG_PROMPT), params, request_id=f"backlog-{i}")
            for i in range(n)]
    tokens: dict[str, int] = {}
    end = time.monotonic() + 300
    while min((tokens.get(r, 0) for r in rids), default=2) < 2:
        for o in d.step():
            tokens[o.request_id] = tokens.get(o.request_id, 0) + len(o.new_token_ids)
        if time.monotonic() > end:
            raise TimeoutError("the backlog requests did not start decoding")
    return rids


def run_arm(d: EngineCore, dw: NixlKVWorker, owner: PrefillProcess, rng: random.Random, arm: str,
            prompt_tokens: int, reps: int, steps_ahead: int) -> list[HandoffRead]:
    reads = []
    for i in range(reps + 1):  # the first is a warm-up
        h = owner.prefill(f"handoff-{arm}-{i}", random_prompt(rng, d, prompt_tokens))
        for _ in range(steps_ahead):
            d.step()
        r = handoff_read(d, dw, owner, h, drain=arm == "idle")
        if i:
            reads.append(r)
    return reads


def summarize(reads: list[HandoffRead], copy: dict) -> dict:
    fence, read = statistics.median(r.fence_s for r in reads), statistics.median(r.read_s for r in reads)
    nbytes = reads[0].nbytes
    out = {"fence_ms": fence * 1e3, "read_ms": read * 1e3, "read_GBps": nbytes / read / 1e9,
           "copy_GBps": nbytes / copy["wall_s"] / 1e9, "ratio": copy["wall_s"] / read,
           "descriptors": [r.descriptors for r in reads], "reads": [asdict(r) for r in reads]}
    if "stream_s" in copy:
        out["ratio_stream"] = copy["stream_s"] / read
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", type=Path, default=Path("configs/h200-1p1d.yaml"))
    p.add_argument("--prompt-tokens", type=int, default=1040,
                   help="the handoff's prompt (1040 at ouro-1.4b-shape: 65 blocks x 4 planes = 818 MB)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--backlog", type=int, default=16, help="requests decoding in the backlog arm (0: no arm)")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size per engine")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    command = " ".join(["python", *sys.argv])
    cluster = load_config(args.config, num_blocks=args.num_blocks)
    dcfg = decode_config(cluster)
    limit = dcfg.max_model_len - HANDOFF_TOKENS
    if not 1 <= args.prompt_tokens <= limit:
        raise SystemExit(f"--prompt-tokens must be in [1, {limit}] (max_model_len - {HANDOFF_TOKENS}), "
                         f"got {args.prompt_tokens}")
    print("command:", command)
    print("machine:", machine())
    print("engine: ", describe_engine(cluster), "| decode side:",
          "GPU features on" if dcfg.device.startswith("cuda") else "CPU defaults", flush=True)
    t_start = time.perf_counter()
    owner = PrefillProcess(cluster.engine_config("prefill"), cluster.transfer.progress_thread,
                           worker_threads(cluster, "prefill"))
    d = dw = None
    try:
        torch.set_num_threads(worker_threads(cluster, "decode"))
        d = EngineCore(dcfg)
        dw = NixlKVWorker("kv-read-decode", kv_pools(d), d.layout.block_size, d.kv_compat(),
                          capture_telemetry=True, progress_thread=cluster.transfer.progress_thread)
        dw.add_peer(owner.info)
        check_pool(d, args)
        rng = random.Random(0)
        reads = {"idle": run_arm(d, dw, owner, rng, "idle", args.prompt_tokens, args.reps, 0)}
        nbytes = reads["idle"][0].nbytes
        copy = copy_baseline(nbytes, d.device, args.reps)
        if args.backlog:
            start_backlog(d, args.backlog, rng)
            reads["backlog"] = run_arm(d, dw, owner, rng, "backlog", args.prompt_tokens, args.reps, STEPS_AHEAD)
    finally:
        if dw is not None:
            dw.close()
        if d is not None:
            d.shutdown()
        owner.close()
    planes = d.model.kv_planes(d.max_loops)
    print(f"handoff: {args.prompt_tokens} prompt tokens, {-(-args.prompt_tokens // dcfg.block_size)} blocks x "
          f"{planes} looped planes (+ flat), {nbytes / 1e6:.1f} MB per READ; median of {args.reps}")
    line = f"torch copy_ of the same bytes: {copy['wall_s'] * 1e3:.3f} ms post to done ({nbytes / copy['wall_s'] / 1e9:.1f} GB/s)"
    if "stream_s" in copy:
        line += f"; back to back {copy['stream_s'] * 1e3:.3f} ms ({nbytes / copy['stream_s'] / 1e9:.1f} GB/s)"
    print(line)
    results = {}
    for arm, rs in reads.items():
        s = results[arm] = summarize(rs, copy)
        extra = f", {s['ratio_stream']:.2f}x back-to-back copies" if "ratio_stream" in s else ""
        who = f"{args.backlog} requests decoding, host {STEPS_AHEAD} Operations ahead" if arm == "backlog" else "nothing else running"
        print(f"[{arm}] ({who}): fence {s['fence_ms']:.3f} ms, then READ {s['read_ms']:.3f} ms = "
              f"{s['read_GBps']:.1f} GB/s = {s['ratio']:.2f}x the copy{extra} (goal >= {GOAL}); "
              f"descriptors {s['descriptors']}", flush=True)
    wall = time.perf_counter() - t_start
    print(f"wall time {wall:.1f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "command": command, "machine": machine(), "engine": describe_engine(cluster),
            "config": str(args.config), "prompt_tokens": args.prompt_tokens, "read_bytes": nbytes,
            "reps": args.reps, "backlog": args.backlog, "copy": copy, "arms": results, "goal": GOAL,
            "wall_s": wall}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
