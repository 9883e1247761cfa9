"""benchmarks/throughput.py on CPU with the tiny model (the smoke run of the GPU table): every
cell's figures follow from its counts, a C the pool cannot hold is reported as not fitting,
fixed depth runs in lockstep at C = 1, the greedy check compares C = 1 with the widest cell,
and the served arm drives `loopserve serve` with the same workload. Nothing here is timed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
P, OUT = 16, 4  # a request needs cdiv(20, 16) = 2 blocks on each of tiny-ouro's 4 planes


def run(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "throughput.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "benchmarks/throughput.py", "--device", "cpu", "--model", "tiny-ouro",
                           "--dtype", "float32", "--prompt-lens", str(P), "--output-len", str(OUT),
                           "--json", str(out), *extra], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_table_on_cpu(tmp_path):
    res = run(tmp_path, "--cs", "1,2,8", "--num-blocks", "16", "--check", "2")  # the pool holds 2 requests
    cells = {(c["mode"], c["c"]): c for c in res["cells"]}
    assert set(cells) == {(m, c) for m in ("fixed", "adaptive") for c in (1, 2, 8)}
    for (mode, c), cell in cells.items():
        assert cell["pool_holds"] == 2
        if c == 8:
            assert not cell["fits"] and cell["output_tokens"] == 0
            continue
        assert cell["fits"] and not cell["cut"] and cell["requests"] == 2 * c
        assert cell["output_tokens"] == 2 * c * OUT
        assert cell["tok_s"] == pytest.approx(cell["output_tokens"] / cell["wall_s"])
        assert cell["floor_s"] > 0 and cell["of_floor"] == pytest.approx(cell["floor_s"] / cell["wall_s"])
        assert cell["tok_per_step"] == pytest.approx(cell["output_tokens"] / cell["steps"])
        if mode == "fixed":
            assert cell["mean_depth"] == 4
        else:
            assert 1 <= cell["mean_depth"] <= 4
    # one request at a time at fixed depth: PRELUDE, 4 loops, CODA per token, i.e. lockstep
    assert cells[("fixed", 1)]["of_lockstep"] == pytest.approx(1.0)
    for c in (1, 2):  # equal requests at fixed depth enter and leave together: every step at width
        assert cells[("fixed", c)]["full_of_lockstep"] == pytest.approx(1.0)
    assert 0 < cells[("adaptive", 2)]["full_of_lockstep"] <= 1.0
    for mode in ("fixed", "adaptive"):
        chk = res["checks"][f"{P}/{mode}"]
        assert chk["c"] == 2 and chk["of"] == 2 and not chk["beyond"]
    assert res["rates"]["copy_GBps"] > 0 and res["rates"]["matmul_TFLOPs"] > 0


def test_table_under_the_mixed_policy(tmp_path):
    """--policy mixed (split prefill on): prompt chunks share decode batches; fixed depth
    still runs in lockstep, and the greedy check holds."""
    res = run(tmp_path, "--cs", "1,2", "--modes", "fixed", "--check", "2", "--policy", "mixed")
    cells = {c["c"]: c for c in res["cells"]}
    for c in (1, 2):
        assert cells[c]["requests"] == 2 * c and cells[c]["output_tokens"] == 2 * c * OUT
        assert cells[c]["of_lockstep"] == pytest.approx(1.0) and cells[c]["full_of_lockstep"] == pytest.approx(1.0)
    assert not res["checks"][f"{P}/fixed"]["beyond"]


def test_served_arm_on_cpu(tmp_path):
    res = run(tmp_path, "--cs", "2", "--modes", "fixed", "--check", "1", "--server-c", "2")
    served = res["served"]
    assert served["c"] == 2 and served["output_tokens"] == 2 * 2 * OUT
    assert served["ratio"] == pytest.approx(served["tok_s"] / served["engine_tok_s"])
    assert "loopserve serving" in (tmp_path / "throughput_serve.log").read_text()


def test_the_greedy_check_lists_an_exit_flip_apart_from_a_difference():
    """A first difference beyond the tie is an exit flip only where the two runs exited that
    token at different depths; at equal depths it is a difference."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from throughput import compare

    from loopserve.bench.workload import RequestResult

    top = [{5: -0.1, 6: -3.0}, {7: -0.1}]
    ref = {"a": RequestResult("a", [5, 7], exit_depths=[2, 3], top_logprobs=top),
           "b": RequestResult("b", [5, 7], exit_depths=[2, 3], top_logprobs=top),
           "c": RequestResult("c", [5, 7], exit_depths=[2, 3], top_logprobs=top)}
    other = [{6: -0.1, 5: -3.0}, {7: -0.1}]
    got = {"a": RequestResult("a", [6, 7], exit_depths=[4, 3], top_logprobs=other),  # flipped depth
           "b": RequestResult("b", [6, 7], exit_depths=[2, 3], top_logprobs=other),  # same depth
           "c": RequestResult("c", [5, 7], exit_depths=[2, 3], top_logprobs=top)}
    chk = compare(ref, got, tie_nats=0.25)
    assert chk["equal"] == 1 and not chk["near_ties"]
    assert chk["exit_flips"] == [{"request": "a", "token": 0, "gap_nats": 2.9, "depths": [2, 4]}]
    assert [b["request"] for b in chk["beyond"]] == ["b"]


def test_a_cell_whose_engine_fails_is_reported_and_the_table_goes_on(tmp_path, monkeypatch, capsys):
    """An engine that fails in one cell (as a GPU out of memory did) fails that cell loudly;
    the next prompt length runs on a fresh engine, the JSON is written, the exit status is 1."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import throughput

    from loopserve.engine.model_runner import ModelRunner

    real = ModelRunner.recurrent

    def recurrent(self, batch, reqs, *a, **k):
        if any(len(r.prompt_token_ids) == 24 for r in reqs.values()):
            raise RuntimeError("CUDA out of memory (injected)")
        return real(self, batch, reqs, *a, **k)

    monkeypatch.setattr(ModelRunner, "recurrent", recurrent)
    out = tmp_path / "t.json"
    rc = throughput.main(["--device", "cpu", "--model", "tiny-ouro", "--dtype", "float32", "--prompt-lens",
                          "16,24,32", "--output-len", "4", "--cs", "1,2", "--modes", "fixed", "--json", str(out)])
    assert rc == 1
    text = capsys.readouterr().out
    ref_line = next(line for line in text.splitlines() if "FAILED (the C = 1 reference)" in line)
    assert ref_line.split()[:2] == ["24", "fixed"] and "CUDA out of memory (injected)" in ref_line
    cells = {(c["prompt_len"], c["c"]): c for c in json.loads(out.read_text())["cells"]}
    for c in (1, 2):
        assert cells[(24, c)]["error"].endswith("engine failed: RuntimeError: CUDA out of memory (injected)")
    for p in (16, 32):
        assert all(cells[(p, c)]["error"] is None and cells[(p, c)]["tok_s"] > 0 for c in (1, 2))
    checks = json.loads(out.read_text())["checks"]
    assert set(checks) == {"16/fixed", "32/fixed"} and not any(ch["beyond"] for ch in checks.values())


def test_after_the_warm_up_an_adaptive_cell_meets_no_graph_it_has_not_captured(monkeypatch):
    """A graph is captured per (Operation, padded size, context bucket) and the state slab's
    version: a growth of the slab drops every graph. The warm-up must leave the slab at the
    cell's peak (C prompts' rows) and every size below C captured after that, so the timed cell
    captures nothing for its decode rows (padded graph path on CPU, `capture=False`; eight
    1024-token prompts grow the slab from its 256 rows to 8K in several steps). Not covered: a prompt whose rows
    but one exited loops that row alone, a decode-shaped batch at the position's context
    bucket (data-dependent; the cell counts those captures)."""
    import argparse
    import math
    import random

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import throughput

    from loopserve.engine import cuda_graphs
    from loopserve.engine.config import EngineConfig
    from loopserve.engine.engine_core import EngineCore

    c, prompt_len, out_len = 8, 1024, 12
    keys: set = set()
    new_in_cell: list = []
    timed = False
    real = cuda_graphs.DecodeGraphs.run

    def run_recording(self, hb, forward, slab_version):
        def recorded(mb):  # the padded batch run() built: its rows and context bucket are the key's
            key = (slab_version, hb.operation, mb.positions.numel(), mb.attn.max_context_len)
            if key not in keys:
                keys.add(key)
                if timed and min(hb.positions) >= prompt_len:  # decode rows (see below)
                    new_in_cell.append(key)
            return forward(mb)

        return real(self, hb, recorded, slab_version)

    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "run", run_recording)
    engine = EngineCore(EngineConfig(model="tiny-ouro", device="cpu", dtype="float32", num_blocks=2200,
                                     block_size=16, max_model_len=1100, seed=0,
                                     scheduler={"max_num_seqs": c, "max_num_batched_tokens": 4096}))
    engine.runner.use_graphs(c, 1100 // 16 + 1, capture=False)
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 250) for _ in range(prompt_len)] for _ in range(2 * c)]
    args = argparse.Namespace(exit_threshold=0.6)
    table = argparse.Namespace(engine=engine, args=args, max_loops=engine.max_loops)
    assert throughput.warm_sizes(table, c) == [8, 4, 2, 1]
    version0 = engine.runner.states.version
    throughput.warm_up(table, prompts, c)
    assert engine.runner.states.version > version0  # the warm-up grew the slab
    timed = True
    results, _ = throughput.closed_loop(engine, prompts, [throughput.params("adaptive", args, engine.max_loops, out_len)]
                                        * (2 * c), c, math.inf)
    depths = {d for r in results.values() for d in r.exit_depths}
    assert len(depths) > 1  # rows left at different depths: the cell met sizes below C
    assert new_in_cell == []


def test_profile_gpu_closed_loop_splits_the_cell_by_batch_kind(capsys):
    """`profile_gpu.py --closed-loop` (the CPU smoke): every step of the cell is counted under
    its batch's kind and Operation (eager on CPU, no graphs), and every token is made."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import profile_gpu

    assert profile_gpu.main(["--device", "cpu", "--model", "tiny-ouro", "--cs", "2", "--prompt-len", "16",
                             "--mode", "adaptive", "--closed-loop", "--output-len", "4"]) == 0
    text = capsys.readouterr().out
    assert "closed loop C=2, P=16, adaptive: 4 requests, 16 tokens" in text
    rows = {line.split()[1]: int(line.split()[2]) for line in text.splitlines() if line.startswith("eager ")}
    assert set(rows) == {"PRELUDE", "RECURRENT", "CODA"}
    assert rows["CODA"] >= 4 * 4 / 2  # 16 tokens, at most 2 requests per CODA batch
