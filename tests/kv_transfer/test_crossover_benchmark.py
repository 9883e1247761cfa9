"""benchmarks/disagg_crossover.py: its measuring function on tiny lengths (real engines, real
NIXL between two processes, CPU) gives one row per length with positive times and the READ's
bytes from the engine's block geometry; the crossover is read off the rows as documented; the
script writes its table and JSON. Nothing here is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from loopserve.bench.crossover import Row, crossover, lengths_for, load_config, measure
from loopserve.engine.engine_core import EngineCore
from loopserve.worker_host.transfer_host import kv_pools

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "cpu-1p1d.yaml"


def test_measure_gives_a_row_per_length_with_the_engines_read_bytes():
    cluster = load_config(CONFIG)
    rows = measure(cluster, [8, 16], reps=1, warmup=0, log=lambda line: None)
    assert [r.n for r in rows] == [8, 16]
    engine = EngineCore(cluster.engine_config("decode"))
    pools, block = kv_pools(engine), engine.layout.block_size
    planes = engine.model.kv_planes(engine.max_loops)
    per_block = sum(t[0].nbytes * (planes if name == "looped" else 1) for name, t in pools.items())
    for r in rows:
        assert r.prefill_ms > 0 and r.transfer_ms > 0
        assert r.ratio == pytest.approx(r.transfer_ms / r.prefill_ms)
        assert r.blocks == -(-r.n // block)
        assert r.read_bytes == r.blocks * per_block
    assert {"tokens", "status", "text"} <= set(crossover(rows))


def _rows(n_prefill_transfer):
    return [Row(n, p, t, t / p, 0, 0) for n, p, t in n_prefill_transfer]


def test_crossover_interpolates_between_the_points_around_the_first_crossing():
    c = crossover(_rows([(10, 1.0, 2.0), (20, 1.5, 2.0), (40, 3.5, 2.5)]))
    assert c["status"] == "interpolated"
    assert c["tokens"] == pytest.approx(20 + 20 * 0.5 / 1.5)
    assert "below_again_at" not in c


def test_crossover_outside_the_range_and_not_monotone():
    assert crossover(_rows([(8, 1.0, 2.0), (16, 1.0, 2.0)]))["status"] == "above largest n"
    below = crossover(_rows([(8, 3.0, 2.0), (16, 4.0, 2.0)]))
    assert below["status"] == "at or below smallest n" and below["tokens"] is None
    wobbly = crossover(_rows([(8, 1.0, 2.0), (16, 2.0, 2.0), (32, 1.9, 2.0)]))
    assert wobbly["tokens"] == pytest.approx(16) and wobbly["below_again_at"] == [32]


def test_lengths_past_max_model_len_are_cut_to_it():
    cfg = load_config(CONFIG, max_model_len=100).engine_config("decode")
    assert lengths_for(cfg, [16, 64, 128, 256]) == [16, 64, 98]


def test_the_script_prints_its_table_and_writes_json(tmp_path):
    out = tmp_path / "cross.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    script = ROOT / "benchmarks" / "disagg_crossover.py"
    proc = subprocess.run([sys.executable, str(script), "--config", str(CONFIG),
                           "--lengths", "8,16", "--reps", "1", "--warmup", "0", "--json", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "prefill ms" in proc.stdout and "crossover" in proc.stdout
    got = json.loads(out.read_text())
    assert [r["n"] for r in got["rows"]] == [8, 16]
    assert all(r["prefill_ms"] > 0 and r["transfer_ms"] > 0 for r in got["rows"])
    assert {"tokens", "status", "text"} <= set(got["crossover"])
    assert got["command"].startswith("python") and got["machine"]
