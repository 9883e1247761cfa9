"""Compile the fused loop kernel (ouro-1.4b-shape, bf16) for sm_90 without a GPU and print
its registers, spills and shared memory (Triton's bundled ptxas and cuobjdump): how many
programs an SM can hold. Usage: MODE=0|1|2|3 [STAGES=4] [PREFETCH=0|1] python benchmarks/fused_loop_regs.py 1x512x8 [BxBKxWARPS ...]
(modes 2, 3 take BK <= 256); also says how many TMA copies the software pipeline issues."""
import os, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import ASTSource
from loopserve.model.fused_loop.kernel import ouro_loop_kernel, PHASES_PER_LAYER

MODE = int(os.environ.get("MODE", "1"))
PREFETCH = bool(int(os.environ.get("PREFETCH", "0")))
STAGES = int(os.environ.get("STAGES", "4"))
def compile_cfg(BB=1, BK=512, nw=8, progs=132, prefetch=False, dtype="bf16"):
    from loopserve.model.fused_loop.ouro_loop import row_tile
    H, I, HQ, HKV, D = 2048, 5632, 16, 16, 128
    nqkv = (HQ + 2 * HKV) * D
    ptr = {"Hidden": dtype, "Out": dtype, "RemIn": "fp32", "RemOut": "fp32", "Score": "fp32", "Positions": "i64",
           "Slots": "i64", "Tables": "i32", "Cos": "fp32", "Sin": "fp32", "Cache": dtype, "Wqkv": dtype, "Wo": dtype,
           "Wgu": dtype, "Wdown": dtype, "Norms": dtype, "WNorm": dtype, "WGate": dtype, "BGate": dtype,
           "Xres": "fp32", "Delta": "fp32", "QKV": "fp32", "GU": "fp32", "Acc": "fp32", "MPart": "fp32",
           "LPart": "fp32", "Merged": "fp32", "Scratch": "fp32", "Count": "i32", "Times": "i64"}
    floats = {"qk_scale", "eps"}
    consts = dict(L=24, H=H, I=I, HQ=HQ, HKV=HKV, HEAD_D=D, PAGE=16, BLOCK_B=BB, BLOCK_H=2048, BLOCK_G=1,
                  BLOCK_N=32, BLOCK_D=128, BLOCK_S=8, BN_QKV=row_tile(nqkv, progs, MODE),
                  BN_O=row_tile(H, progs, MODE), BN_GU=row_tile(2 * I, progs, MODE), BN_DOWN=row_tile(H, progs, MODE), BK=BK,
                  PHASES=PHASES_PER_LAYER, USE_BARRIER=True, PREFETCH=prefetch, NEXT_BYTES=65536, GEMV_MODE=MODE, TIMING=False, INTERPRET=False)
    bns = {"DWqkv": consts["BN_QKV"], "DWo": consts["BN_O"], "DWgu": consts["BN_GU"], "DWdown": consts["BN_DOWN"]}
    consts.update(STAGES=STAGES)
    if MODE < 2:
        consts.update({d: None for d in bns})
    sig = {}
    for a in ouro_loop_kernel.arg_names:
        if a in consts: sig[a] = "constexpr"
        elif a in ptr: sig[a] = "*" + ptr[a]
        elif a in bns: sig[a] = f"tensordesc<{dtype}[{bns[a]}, {BK}]>"
        elif a in floats: sig[a] = "fp32"
        else: sig[a] = "i32"
    src = ASTSource(ouro_loop_kernel, sig, consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw, "num_stages": STAGES})
    tma = sum("async_tma_copy" in l for l in k.asm["ttgir"].splitlines())
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    cuobj = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    res = subprocess.run([cuobj, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    line = [l for l in res.splitlines() if "REG" in l]
    print(f"BB={BB} BK={BK} nw={nw} prefetch={prefetch} mode={MODE} stages={STAGES}: shared={k.metadata.shared} "
          f"TMA copies in the IR={tma}", line[-1].strip() if line else res[-300:])
    return k

if __name__ == "__main__":
    for c in sys.argv[1:] or ["1x512x8"]:
        bb, bk, nw = (int(v) for v in c.split("x"))
        compile_cfg(bb, bk, nw, prefetch=PREFETCH)
