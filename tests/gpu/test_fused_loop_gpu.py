"""GPU twin of tests/model/test_fused_loop_interp.py: the persistent kernel with its grid
barrier (and the L2 prefetch the interpreter cannot run) against the per-layer path."""

import pytest
import torch

from loopserve.model.config import OuroConfig
from loopserve.model.registry import build_model
from tests.gpu.fused_cases import compare, make_case

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# several GEMV tiles per program, GQA (group 2), a non-power-of-two intermediate size
MID = OuroConfig(architectures=["OuroForCausalLM"], hidden_size=512, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
                 head_dim=64, intermediate_size=1408, vocab_size=384, rope_theta=10000.0)


@pytest.fixture(scope="module")
def models():
    return {dt: build_model(MID, dtype=dt, device="cuda", seed=0) for dt in (torch.float32, torch.bfloat16)}


@pytest.mark.parametrize("rows", [1, 3, 8])
@pytest.mark.parametrize("barrier", [True, False])
def test_fused_loop_equals_per_layer_fp32(models, rows, barrier):
    from loopserve.model.fused_loop.ouro_loop import OuroFusedLoop

    torch.backends.cuda.matmul.allow_tf32 = False
    m = models[torch.float32]
    positions = [5, 0, 700, 9, 130, 64, 1, 333][:rows]
    case = make_case(m, positions, [1 + i % 3 for i in range(rows)], 16, torch.float32, device="cuda",
                     pad_rows=1 if rows == 3 else 0)
    compare(m, OuroFusedLoop(m, use_barrier=barrier), case, atol=1e-4)


@pytest.mark.parametrize("config", [dict(), dict(block_k=256, num_warps=4, programs_per_sm=2),
                                    dict(prefetch=False)])
def test_fused_loop_bf16_variants(models, config):
    from loopserve.model.fused_loop.ouro_loop import OuroFusedLoop

    m = models[torch.bfloat16]
    case = make_case(m, [17, 260, 3, 1000], [1, 2, 3, 4], 16, torch.bfloat16, device="cuda")
    compare(m, OuroFusedLoop(m, **config), case, atol=6e-2)


def test_cuda_engine_with_fused_loop_matches_dense_reference_fp32():
    """Decode steps through the fused kernel under CUDA graphs keep the dense reference's tokens."""
    from loopserve.engine.config import EngineConfig
    from loopserve.engine.engine_core import EngineCore
    from loopserve.model.dense_reference import dense_greedy_generate
    from loopserve.model.registry import resolve_model
    from tests.engine.conftest import workload

    torch.backends.cuda.matmul.allow_tf32 = False
    model = resolve_model("tiny-ouro", dtype=torch.float32, device="cuda", seed=0)
    engine = EngineCore(EngineConfig(model="tiny-ouro", device="cuda", dtype="float32", block_size=16,
                                     num_blocks=1024, max_model_len=128, fused_loop="on"), model=model)
    work = workload(seed=1, n=6)
    for rid, prompt, params in work:
        engine.add_request(prompt, params, request_id=rid)
    outs: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert model.fused_loop.runs > 0  # captured into graphs at least once per size
    model.use_fused_loop(0)
    for rid, prompt, params in work:
        d = model.default_loop_params
        p = params.resolve_loops(d.min_loops, d.max_loops, d.exit_threshold, model.max_loops)
        ref, _ = dense_greedy_generate(model, prompt, p.max_tokens, p.min_loops, p.max_loops,
                                       p.exit_threshold, p.seed)
        assert outs[rid] == ref, rid
