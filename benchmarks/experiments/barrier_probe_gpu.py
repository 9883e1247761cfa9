"""Probe: cost of an atomic grid barrier inside a persistent Triton kernel on the H200."""
import torch, triton, triton.language as tl, time

@triton.jit
def _barrier(Count, target):
    tl.atomic_add(Count, 1, sem="release", scope="gpu")
    c = tl.atomic_add(Count, 0, sem="acquire", scope="gpu")
    while c < target:
        c = tl.atomic_add(Count, 0, sem="acquire", scope="gpu")

@triton.jit
def _k(Count, X, n_bar, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(n_bar):
        acc += tl.load(X + pid * BLOCK + tl.arange(0, BLOCK))
        _barrier(Count, (i + 1) * npg)
    tl.store(X + pid * BLOCK + tl.arange(0, BLOCK), acc)

@triton.jit
def _gemv(W, X, Y, Count, N, K, n_rep, BN: tl.constexpr, BK: tl.constexpr, BAR: tl.constexpr):
    """y = W x, tiles of BN rows, grid-stride over tiles; n_rep repeats with barriers between."""
    pid = tl.program_id(0)
    npg = tl.num_programs(0)
    ntiles = tl.cdiv(N, BN)
    for r in range(n_rep):
        for t in range(pid, ntiles, npg):
            rows = t * BN + tl.arange(0, BN)
            acc = tl.zeros([BN], tl.float32)
            for k0 in range(0, K, BK):
                ks = k0 + tl.arange(0, BK)
                w = tl.load(W + r * N * K + rows[:, None] * K + ks[None, :])
                x = tl.load(X + ks)
                acc += tl.sum(w.to(tl.float32) * x.to(tl.float32)[None, :], axis=1)
            tl.store(Y + rows, acc)
        if BAR:
            _barrier(Count, (r + 1) * npg)

print("triton", triton.__version__, "torch", torch.__version__)
try:
    import triton.language.extra.cuda as ec
    print("gdc:", hasattr(ec, "gdc_wait"), hasattr(ec, "gdc_launch_dependents"))
except Exception as e:
    print("no extra.cuda", e)
dev = "cuda"
sms = torch.cuda.get_device_properties(0).multi_processor_count
cnt = torch.zeros(1, dtype=torch.int32, device=dev)
X = torch.zeros(sms * 128, device=dev)
for nb in (1, 1000):
    cnt.zero_(); _k[(sms,)](cnt, X, nb, BLOCK=128); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        cnt.zero_(); _k[(sms,)](cnt, X, nb, BLOCK=128)
    torch.cuda.synchronize()
    print(f"barriers={nb}: {(time.perf_counter()-t0)/5*1e6:.1f} us per kernel")
# GEMV shapes: stacked copies so L2 can't hold them
for (N, K) in ((6144, 2048), (2048, 2048), (11264, 2048), (2048, 5632)):
    reps = 24
    W = torch.randn(reps, N, K, device=dev, dtype=torch.bfloat16)
    x = torch.randn(K, device=dev, dtype=torch.bfloat16)
    y = torch.empty(N, device=dev, dtype=torch.float32)
    gb = W.numel() * 2 / 1e9
    for BN, BK, nw, grid in ((16, 512, 4, sms), (32, 256, 4, sms), (16, 256, 4, sms), (8, 1024, 4, sms), (16, 512, 8, sms), (32, 512, 8, sms), (16, 512, 4, 2 * sms)):
        if N % BN: continue
        try:
            for _ in range(2):
                cnt.zero_(); _gemv[(grid,)](W, x, y, cnt, N, K, reps, BN=BN, BK=BK, BAR=True, num_warps=nw)
            torch.cuda.synchronize()
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
            ev[0].record()
            for _ in range(10):
                cnt.zero_(); _gemv[(grid,)](W, x, y, cnt, N, K, reps, BN=BN, BK=BK, BAR=True, num_warps=nw)
            ev[1].record(); torch.cuda.synchronize()
            ms = ev[0].elapsed_time(ev[1]) / 10
            print(f"N={N} K={K} BN={BN} BK={BK} w={nw} grid={grid}: {ms/reps*1e3:.2f} us/gemv {gb/ms*1e3/1e3*1:.0f}.. GB/s={gb/(ms/1e3):.0f}")
        except Exception as e:
            print("fail", BN, BK, nw, type(e).__name__, str(e)[:200])
    ref = (W[0].float() @ x.float())
    cnt.zero_(); _gemv[(sms,)](W, x, y, cnt, N, K, 1, BN=16, BK=512, BAR=True, num_warps=4)
    print("err", (y - ref).abs().max().item())
    # cuBLAS baseline over the same stacked weights
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
    for _ in range(2):
        for r in range(reps): torch.mv(W[r], x)
    ev[0].record()
    for _ in range(10):
        for r in range(reps): torch.mv(W[r], x)
    ev[1].record(); torch.cuda.synchronize()
    ms = ev[0].elapsed_time(ev[1]) / 10
    print(f"cuBLAS N={N} K={K}: {ms/reps*1e3:.2f} us/gemv GB/s={gb/(ms/1e3):.0f}")
    del W
