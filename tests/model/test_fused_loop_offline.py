"""The fused loop kernel the H200 gets, checked without a GPU: compiled for sm_90 from the
launcher's own arguments through the JIT's specialisation (model/fused_loop/offline.py).

The GPU tests cannot run in CI, so a change that breaks the weights' 16-byte alignment (the
compiler falls back to one 2-byte load per weight) or makes the kernel spill would only show
up as a slower device run; these catch it here. The test session runs Triton under its
interpreter (conftest.py), so the compile runs in a child process without it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

_CHILD = r"""
import json, sys
from loopserve.model.fused_loop.offline import compile_for_hopper, meta_model, resource_usage, weight_loads
from loopserve.model.fused_loop.ouro_loop import OuroFusedLoop
fused = OuroFusedLoop(meta_model("ouro-1.4b-shape"), max_rows=1, use_barrier=True, **json.loads(sys.argv[1]))
k = compile_for_hopper(fused, rows=1)
print(json.dumps({"usage": resource_usage(k), "loads": weight_loads(k), "warps": fused.num_warps}))
"""


def _compile(**fused_kw) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(fused_kw)], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("fused_kw", [{}, {"num_warps": 8}, {"w_ahead": 2}, {"prefetch_own": True}],
                         ids=["engine-default", "8-warps", "two-chunks-ahead", "prefetch-own-tiles"])
def test_weights_stream_in_16_byte_loads_without_spills(fused_kw):
    r = _compile(**fused_kw)
    loads, usage = r["loads"], r["usage"]
    assert loads, "no weight loads found in the PTX"
    narrow = {k: v for k, v in loads.items() if ".v4." not in k}
    assert not narrow, f"weights loaded in fewer than 16 bytes per instruction: {narrow}"
    assert usage["STACK"] == 0 and usage["LOCAL"] == 0, f"the kernel spills: {usage}"
    regs_per_warp = -(-usage["REG"] * 32 // 256) * 256
    assert regs_per_warp * r["warps"] <= 65536, f"one program does not fit an SM's registers: {usage}"
