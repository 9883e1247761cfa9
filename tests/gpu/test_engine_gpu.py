"""CUDA twins of the CPU equivalence tests (skipped without a GPU)."""

import pytest
import torch

from loopserve.engine.config import EngineConfig
from loopserve.engine.engine_core import EngineCore
from loopserve.model.dense_reference import dense_greedy_generate
from loopserve.model.registry import resolve_model
from tests.engine.conftest import workload

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("family", ["tiny-huginn", "tiny-ouro"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_engine_matches_dense_reference(family, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    model = resolve_model(family, dtype=getattr(torch, dtype), device="cuda", seed=0)
    e = EngineCore(EngineConfig(model=family, device="cuda", dtype=dtype, block_size=16,
                                num_blocks=1024, max_model_len=128), model=model)
    work = workload(seed=1, n=8)
    for rid, prompt, params in work:
        e.add_request(prompt, params, request_id=rid)
    outs = {}
    while e.has_unfinished():
        for o in e.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    e.check_no_leaks()
    agree = 0
    for rid, prompt, params in work:
        d = model.default_loop_params
        p = params.resolve_loops(d.min_loops, d.max_loops, d.exit_threshold, model.max_loops)
        ref, _ = dense_greedy_generate(model, prompt, p.max_tokens, p.min_loops, p.max_loops,
                                       p.exit_threshold, p.seed)
        if dtype == "float32":
            assert outs[rid] == ref, rid
        agree += outs[rid][:4] == ref[:4]
    assert agree >= len(work) // 2  # bf16: paged and dense round differently; most prefixes agree


@pytest.mark.parametrize("family", ["tiny-huginn", "tiny-ouro"])
def test_cuda_graph_decode_equals_eager(family):
    """Captured decode graphs (several padded sizes and context buckets) give the eager
    engine's tokens and exit depths in fp32."""
    torch.backends.cuda.matmul.allow_tf32 = False
    model = resolve_model(family, dtype=torch.float32, device="cuda", seed=0)
    got = {}
    for graphs in (False, True):
        e = EngineCore(EngineConfig(model=family, device="cuda", block_size=16, num_blocks=1024,
                                    max_model_len=256, max_num_seqs=12, cuda_graphs=graphs), model=model)
        outs = {}
        for rid, prompt, params in workload(seed=2, n=11, max_tokens=40):
            e.add_request(prompt * 4, params, request_id=rid)  # contexts cross the 128 bucket
        while e.has_unfinished():
            for o in e.step():
                toks, depths = outs.setdefault(o.request_id, ([], []))
                toks.extend(o.new_token_ids)
                depths.extend(o.exit_depths)
        e.check_no_leaks()
        got[graphs] = outs
        assert (e.runner.graphs is not None and e.runner.graphs.runs > 0) == graphs
    assert got[True] == got[False]
