"""The fused loop kernel compiled for Hopper (sm_90) without a GPU, as the GPU's JIT would.

CI has no GPU, but what the device runs can still be checked here: the launcher's own
arguments (`OuroFusedLoop.launch_args` on the meta device, so no weights exist) through
Triton's JIT specialisation (`native_specialize_impl`: 16-byte aligned pointers and integers
divisible by 16 marked, integers equal to 1 folded to constants), compiled with the ptxas
bundled in the Triton wheel. Without that specialisation the compiler assumes unaligned
pointers and loads each bf16 weight alone (a 2-byte load where the GPU's kernel makes a
16-byte one), so register and load counts from a bare signature are not the device's.
The Triton version here can differ from the device's: treat counts as this version's.
"""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
from collections import Counter

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler.compiler import ASTSource

from loopserve.model.batch import LoopState, host_batch
from loopserve.model.fused_loop.kernel import ouro_loop_kernel
from loopserve.model.fused_loop.ouro_loop import OuroFusedLoop
from loopserve.model.paged_kv import PagedKVCache
from loopserve.model.registry import resolve_model
from loopserve.scheduler.types import Operation

META = torch.device("meta")
HOPPER = GPUTarget("cuda", 90, 32)
H200_SMS = 132
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def meta_model(name: str = "ouro-1.4b-shape") -> torch.nn.Module:
    """The model with shapes only (meta device): no weights allocated or initialised."""
    with META:
        return resolve_model(name, dtype=torch.bfloat16, device=META)


def jit_source(fused: OuroFusedLoop, rows: int, context: int = 256,
               programs: int = H200_SMS) -> tuple[ASTSource, dict]:
    """The kernel source as the JIT specialises it for a decode batch of `rows` at a
    `context`-token context over a `programs`-program grid, and its launch options."""
    model = fused.model
    bs = 16
    per_req = -(-(context + 1) // bs)
    kv = PagedKVCache(model.kv_spec, bs, rows * per_req + 1, 0, torch.bfloat16, META)
    tables = [list(range(1 + i * per_req, 1 + (i + 1) * per_req)) for i in range(rows)]
    mb = host_batch(Operation.RECURRENT, [[context]] * rows, tables, bs, [1] * rows).to(META)
    state = LoopState(torch.empty(rows, model.config.hidden_size, dtype=torch.bfloat16, device=META),
                      torch.empty(rows, device=META))
    args, consts, _ = fused.launch_args(mb, state, kv, programs, run=False)
    args = (*args, 0, fused.n_phases)  # the whole loop
    options = {k: consts.pop(k) for k in ("num_warps", "num_stages")}
    names = [n for n in ouro_loop_kernel.arg_names if n not in consts]
    signature, attrs = {}, {}
    for name, value in zip(names, args, strict=True):
        kind, key = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[name] = kind
        if kind == "constexpr":
            consts[name] = value
        elif key:
            attrs[(ouro_loop_kernel.arg_names.index(name),)] = BaseBackend.parse_attr(key)
    signature.update({n: "constexpr" for n in consts})
    return ASTSource(ouro_loop_kernel, signature, consts, attrs), options


def compile_for_hopper(fused: OuroFusedLoop, rows: int, **kw):
    """The compiled kernel (Triton's CompiledKernel: asm["ptx"], asm["cubin"], metadata)."""
    src, options = jit_source(fused, rows, **kw)
    return triton.compile(src, target=HOPPER, options=options)


def _cuobjdump(kernel, flag: str) -> str:
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([os.path.join(_BIN, "cuobjdump"), flag, f.name], capture_output=True, text=True,
                              check=True).stdout


def resource_usage(kernel) -> dict[str, int]:
    """cuobjdump's resource line as numbers: REG (per thread), STACK, LOCAL (bytes of spills), SHARED, ..."""
    line = next(x for x in _cuobjdump(kernel, "--dump-resource-usage").splitlines() if "REG:" in x)
    return {k: int(v) for k, v in re.findall(r"([A-Z]+(?:\[\d+\])?):(\d+)", line)}


def sass(kernel) -> str:
    return _cuobjdump(kernel, "-sass")


def weight_loads(kernel) -> Counter:
    """The register GEMVs' weight loads (the kernel's only evict-first loads) by PTX instruction."""
    return Counter(x for x in re.findall(r"ld\.global(?:\.[a-zA-Z0-9_:]+)*", kernel.asm["ptx"]) if "evict_first" in x)


def async_copies(kernel) -> dict[str, int]:
    """Copies into shared memory in the PTX: cp.async (Triton's software pipeline, GEMV mode 1)
    and TMA bulk tensor copies (modes 2, 3)."""
    ptx = kernel.asm["ptx"]
    return {"cp.async": len(re.findall(r"cp\.async\.c[ag]\.shared\.global", ptx)),
            "tma": len(re.findall(r"cp\.async\.bulk\.tensor", ptx))}
