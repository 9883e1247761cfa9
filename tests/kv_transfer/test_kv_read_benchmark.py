"""benchmarks/kv_read_gpu.py on CPU (real engines in two processes, NIXL over UCX tcp,cma): the
smoke run of the GPU benchmark. It READs a handoff's every plane with few descriptors (NIXL
merged the blocks), reports the fence and the READ apart in both arms, and the copy baseline
of the same bytes. Nothing here is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from loopserve.bench.crossover import load_config
from loopserve.engine.engine_core import EngineCore
from loopserve.intmath import cdiv
from loopserve.worker_host.transfer_host import kv_pools

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "cpu-1p1d.yaml"
PROMPT = 64


def test_kv_read_benchmark_smoke_on_cpu(tmp_path):
    out = tmp_path / "kv_read.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/kv_read_gpu.py", "--config", str(CONFIG),
                           "--prompt-tokens", str(PROMPT), "--reps", "2", "--backlog", "2", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "x the copy" in proc.stdout
    res = json.loads(out.read_text())
    engine = EngineCore(load_config(CONFIG).engine_config("decode"))
    pools, planes = kv_pools(engine), engine.model.kv_planes(engine.max_loops)
    blocks = cdiv(PROMPT, engine.layout.block_size)
    per_block = {name: t[0].nbytes * (planes if name == "looped" else 1) for name, t in pools.items()}
    assert res["read_bytes"] == blocks * sum(per_block.values())
    assert res["copy"]["wall_s"] > 0
    assert set(res["arms"]) == {"idle", "backlog"}
    for arm in res["arms"].values():
        assert len(arm["reads"]) == 2
        assert arm["fence_ms"] >= 0 and arm["read_ms"] > 0
        assert abs(arm["ratio"] - arm["read_GBps"] / arm["copy_GBps"]) <= 1e-9 * arm["ratio"]
        # one descriptor per run of adjacent blocks: at least one per pool, far fewer than blocks
        assert all(len(pools) <= n < blocks * (planes + ("flat" in pools)) for n in arm["descriptors"])
