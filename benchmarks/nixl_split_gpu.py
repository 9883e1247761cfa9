"""Does splitting one big cuda_ipc NIXL READ into k concurrent transfers beat one?

Two processes on one GPU (as gpu_h200.py part 4), 512 and 2048 blocks of 3 MiB, k = 1..16
transfers posted at once; ratios against torch's D2D copy of the same bytes (CUDA events).

Usage (from the repository root): python benchmarks/nixl_split_gpu.py
"""
import multiprocessing as mp, time, sys
import numpy as np, torch
sys.path.insert(0, ".")
from benchmarks.gpu_h200 import _nixl_owner, cuda_time
from loopserve.kv_transfer.nixl_agent import NixlKVWorker

def main():
    nblk = 2048
    shape = (nblk, 24, 2, 16, 16, 128)
    ctx = mp.get_context("spawn"); a, b = ctx.Pipe()
    p = ctx.Process(target=_nixl_owner, args=(b, shape, 16)); p.start()
    info = a.recv()
    local = torch.zeros(shape, dtype=torch.bfloat16, device="cuda")
    w = NixlKVWorker("gpu-decode", {"looped": local}, 16, {"m": 1})
    w.add_peer(info)
    peer = w._peers["gpu-prefill"]
    for count in (512, 2048):
        src = torch.empty_like(local[:count])
        tc = cuda_time(lambda: src.copy_(local[:count]))
        nbytes = count * local[0].numel() * 2
        del src; torch.cuda.empty_cache()
        for k in (1, 2, 4, 8, 16):
            best = 1e9
            for rep in range(5):
                parts = np.array_split(np.arange(count, dtype=np.int32), k)
                t0 = time.perf_counter()
                hs = [w.agent.make_prepped_xfer("READ", w._dlist, q, peer.dlist, q, b"") for q in parts]
                for h in hs: assert w.agent.transfer(h) != "ERR"
                pending = list(hs)
                while pending:
                    pending = [h for h in pending if w.agent.check_xfer_state(h) != "DONE"]
                best = min(best, time.perf_counter() - t0)
                for h in hs: h.release()
            print(f"{count} blocks ({nbytes/2**30:.2f} GiB) k={k:2d}: {nbytes/best/1e9:7.1f} GB/s vs copy {nbytes/tc/1e9:7.1f} -> {tc/best:.2f}x", flush=True)
    a.send("stop"); p.join(30); w.close()

if __name__ == "__main__":
    main()
