"""GPU twin of tests/model/test_fused_loop_interp.py: the persistent kernel with its grid
barrier against the per-layer path."""

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


@pytest.mark.parametrize("config", [dict(), dict(block_k=256, num_warps=4)])
def test_fused_loop_bf16_variants(models, config):
    from loopserve.model.fused_loop.ouro_loop import OuroFusedLoop

    m = models[torch.bfloat16]
    case = make_case(m, [17, 260, 3, 1000], [1, 2, 3, 4], 16, torch.bfloat16, device="cuda")
    compare(m, OuroFusedLoop(m, **config), case, atol=6e-2)


def test_fused_loop_pool_past_two_to_the_31_elements(models):
    """The fused loop's K/V write and attention address blocks past 2^31 pool elements."""
    from loopserve.model.fused_loop.ouro_loop import OuroFusedLoop

    m = models[torch.bfloat16]
    per_block = 3 * 2 * 16 * 4 * 64  # looped layers, K/V, block_size, Hkv, head_dim
    case = make_case(m, [17, 260, 3, 1000], [1, 2, 3, 4], 16, torch.bfloat16, device="cuda",
                     first_block=(1 << 31) // per_block + 8)
    assert case[0].looped.numel() > 1 << 31
    compare(m, OuroFusedLoop(m), case, atol=6e-2)
