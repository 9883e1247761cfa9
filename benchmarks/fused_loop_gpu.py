"""One Ouro loop at decode batch sizes: the fused persistent kernel vs the per-layer kernels.

Both run the same RECURRENT Operation on the same state and KV pool, each under a CUDA graph;
prints µs per loop, the loop's weight-read bound (its layer weights / the torch copy
bandwidth measured here, bytes read + written per second of a 1 GiB copy timed eagerly as
gpu_h200.py does: a copy replayed from a graph runs as a memcpy node at ~2/3 of that rate), the
ratios, and the largest output difference.

Usage: python benchmarks/fused_loop_gpu.py [--batches 1,8] [--context 256] [--model ouro-1.4b-shape]
       [--configs 512x16] [--phase-times]

--phase-times: after timing each grid-barrier variant, one more loop with the kernel's
%globaltimer stamps on, printed per phase kind (kernel.py's _stamp): the phase's wall time
(first start to the next phase's first start), and the slowest program's time to build its
input vector (the norm, the split merge, SwiGLU) and to finish its work.
"""

from __future__ import annotations

import argparse
import sys

import torch

from loopserve.engine.host_batch import host_batch
from loopserve.intmath import cdiv
from loopserve.model.batch import LoopState
from loopserve.model.fused_loop.kernel import PHASES_PER_LAYER
from loopserve.model.fused_loop.ouro_loop import OuroFusedLoop
from loopserve.model.layers import fuse_elementwise
from loopserve.model.paged_kv import PagedKVCache
from loopserve.model.registry import resolve_model
from loopserve.scheduler.types import Operation


def graph_time(fn, calls: int = 50, replays: int = 5) -> float:
    """Seconds per call, from CUDA-graph replays of `calls` back-to-back calls."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(calls):
            fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / (replays * calls)


def copy_gbps() -> float:
    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    y.copy_(x)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(10):
        y.copy_(x)
    b.record()
    torch.cuda.synchronize()
    t = a.elapsed_time(b) / 1e3 / 10
    return 2 * x.numel() * 2 / t / 1e9


def phase_report(times: torch.Tensor) -> str:
    """µs per phase kind, averaged over layers, from [phases, programs, 3] ns stamps (-1: the
    program had no work in that phase)."""
    t = times.cpu().double()
    start = torch.where(t[..., 0] >= 0, t[..., 0], float("inf")).amin(1)
    end = t[..., 2].amax(1)
    wall = torch.cat([start[1:] - start[:-1], (end[-1:] - start[-1:])])
    has = t[..., 1] >= 0
    prologue = torch.where(has, t[..., 1] - t[..., 0], 0.0).amax(1)
    work = torch.where(t[..., 2] >= 0, t[..., 2] - t[..., 0], 0.0).amax(1)
    kinds = ["qkv", "attn", "o", "gateup", "down"]
    lines = [f"loop {float(end[-1] - start[0]) / 1e3:.1f} us (stamped)"]
    for k, name in enumerate(kinds + ["final"]):
        sel = slice(k, -1, PHASES_PER_LAYER) if name != "final" else slice(-1, None)
        w, pr, wk = (float(x[sel].mean()) / 1e3 for x in (wall, prologue, work))
        n = wall[sel].numel()
        lines.append(f"  {name:7s} wall {w:6.2f} us x{n} = {w * n:7.1f} us; slowest program: input {pr:5.2f}, "
                     f"work {wk:6.2f}, so barrier + skew {w - wk:5.2f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--model", default="ouro-1.4b-shape")
    ap.add_argument("--configs", default="512x16",
                    help="fused kernel variants, comma-separated BLOCK_K x num_warps; the first also runs "
                         "per-phase launches")
    ap.add_argument("--phase-times", action="store_true")
    args = ap.parse_args()
    print("command: python " + " ".join(sys.argv), flush=True)
    torch.manual_seed(0)
    model = resolve_model(args.model, dtype=torch.bfloat16, device=torch.device("cuda"), seed=0)
    fuse_elementwise()
    cfg, bs = model.config, 16
    layer_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".layers." in n)
    bound = layer_bytes / (copy_gbps() * 1e9)
    per_req = cdiv(args.context + 1, bs)
    for batch in (int(b) for b in args.batches.split(",")):
        kv = PagedKVCache(model.kv_spec, bs, batch * per_req + 1, 0, torch.bfloat16, torch.device("cuda"))
        kv.looped.normal_(0, 0.5)
        tables = [list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for i in range(batch)]
        hb = host_batch(Operation.RECURRENT, [[args.context]] * batch, tables, bs, [1] * batch)
        mb = hb.to(torch.device("cuda"))
        state = LoopState(torch.randn(batch, cfg.hidden_size, device="cuda", dtype=torch.bfloat16),
                          torch.ones(batch, device="cuda"))
        results = {}
        variants = [("per-layer kernels", None)]
        for i, c in enumerate(args.configs.split(",")):
            bk, nw = (int(v) for v in c.split("x"))
            kw = dict(block_k=bk, num_warps=nw)
            if i == 0:
                variants.append((f"fused {c}, per-phase launches", OuroFusedLoop(model, 64, use_barrier=False, **kw)))
            variants.append((f"fused {c}, grid barrier", OuroFusedLoop(model, 64, **kw)))
        for name, fused in variants:
            model.fused_loop = fused
            out = {}

            def step() -> None:
                out["r"] = model.recurrent(mb, state, kv)

            with torch.inference_mode():
                try:
                    t = graph_time(step, calls=1, replays=50)
                except Exception as e:  # report and go on with the other variants
                    print(f"[fused] batch {batch} {name}: FAILED {type(e).__name__}: {str(e)[:400]}", flush=True)
                    continue
            results[name] = out["r"]
            diff = ""
            if name != "per-layer kernels" and "per-layer kernels" in results:
                (ref, ref_score), (got, score) = results["per-layer kernels"], out["r"]
                diff = (f"; max |Δhidden| {(ref.hidden.float() - got.hidden.float()).abs().max().item():.3g}"
                        f" (|hidden| max {ref.hidden.float().abs().max().item():.3g}),"
                        f" max |Δscore| {(ref_score - score).abs().max().item():.3g}")
            print(f"[fused] batch {batch} {name}: {t * 1e6:8.1f} us/loop = {t / bound:.2f}x the weight-read "
                  f"bound {bound * 1e6:.1f} us{diff}", flush=True)
            if args.phase_times and fused is not None and fused.use_barrier:
                fused.phase_times = True
                with torch.inference_mode():
                    for _ in range(3):
                        step()
                torch.cuda.synchronize()
                fused.phase_times = False
                print(phase_report(fused.last_phase_times), flush=True)
        model.fused_loop = None


if __name__ == "__main__":
    main()
