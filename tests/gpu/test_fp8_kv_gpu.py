"""The FP8 KV cache on CUDA (issue 42): the Triton write and paged attention kernels and the
fused loop on an FP8 pool against the torch path on the same pool (dequantized), at
model-like sizes, and engines (bf16 weights, FP8 KV, with and without the GPU features) within
the teacher-forced logprob bound of docs/design.md ("FP8 KV cache") against the fp32 dense
reference. CPU twins: tests/model (interpreter), tests/engine/test_fp8_kv.py."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)  # keep the kernels un-imported on CPU

from loopserve.engine.config import GPU_FEATURES, GPU_PATHS_OFF, EngineConfig  # noqa: E402
from loopserve.engine.engine_core import EngineCore  # noqa: E402
from loopserve.model.attention.triton_backend import TritonAttention  # noqa: E402
from loopserve.model.paged_kv import FP8  # noqa: E402
from loopserve.model.registry import build_model, resolve_model  # noqa: E402
from tests.fp8_accuracy import BOUNDS, fixed_depth, prompt, run_engine, teacher_forced_gap  # noqa: E402
from tests.gpu.attn_cases import FP8_SCALES, assert_matches, count_attention_launches, make_case  # noqa: E402
from tests.gpu.attn_cases import random_segments  # noqa: E402
from tests.gpu.fused_cases import compare  # noqa: E402
from tests.gpu.fused_cases import make_case as fused_case  # noqa: E402
from tests.gpu.test_fused_loop_gpu import MID  # noqa: E402
from tests.real_shapes import LONG_PROMPTS, MAX_MODEL_LEN  # noqa: E402

BF16 = torch.bfloat16


@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_mixed_context_lengths(block_size):
    ctx = [1, 2, 15, 16, 17, 63, 64, 65, 1000, 2047, 3000] * 4
    case = make_case([[c - 1] for c in ctx], hq=32, hkv=8, head_dim=128, block_size=block_size,
                     dtype=BF16, device="cuda", kv_scales=FP8_SCALES)
    assert_matches(case, TritonAttention())


@pytest.mark.parametrize("kv_splits", [None, 4])
@pytest.mark.parametrize("block_size", [16, 64])
def test_decode_one_head_per_kv_head(block_size, kv_splits, monkeypatch):
    """Ouro's heads (16 x 128, G = 1), decode rows: `_decode_fma_kernel` serves them."""
    ctx = [1, 2, 15, 16, 17, 63, 64, 65, 1000, 2047, 3000] * 4
    case = make_case([[c - 1] for c in ctx], hq=16, hkv=16, head_dim=128, block_size=block_size,
                     dtype=BF16, device="cuda", kv_scales=FP8_SCALES)
    spies = count_attention_launches(monkeypatch)
    assert_matches(case, TritonAttention(kv_splits=kv_splits))
    assert (spies["fma"].launches, spies["dot"].launches) == (1, 0)


@pytest.mark.parametrize("seed", [0, 1])
def test_random_batches_and_split_kv(seed):
    case = make_case(random_segments(seed, 24, 2500, 300), hq=16, hkv=4, head_dim=128,
                     block_size=16, dtype=BF16, device="cuda", seed=seed, kv_scales=FP8_SCALES)
    assert_matches(case, TritonAttention())
    assert_matches(case, TritonAttention(kv_splits=4))


@pytest.mark.parametrize("rope", ["half", "interleaved"])
def test_prefill_chunks_with_rope_fused_into_the_quantizing_write(rope):
    """A 1k fresh prompt (SDPA on the rows, rounded as the plane holds them), later chunks with
    gaps, decode rows."""
    chunk = [p for p in range(512, 1400) if p % 7]
    segs = [list(range(1024)), chunk, chunk[::3], [77], [2900]]
    case = make_case(segs, hq=40, hkv=5, head_dim=96, block_size=16, dtype=BF16, device="cuda",
                     seed=11, strided_q=True, rope=rope, kv_scales=FP8_SCALES)
    assert_matches(case, TritonAttention())
    assert_matches(case, TritonAttention(dense_prefill_rows=None))


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (BF16, 6e-2)])
@pytest.mark.parametrize("barrier", [True, False])
def test_fused_loop(dtype, atol, barrier):
    from loopserve.model.fused_loop.ouro_loop import OuroFusedLoop

    torch.backends.cuda.matmul.allow_tf32 = False
    m = build_model(MID, dtype=dtype, device="cuda", seed=0)
    case = fused_case(m, [17, 260, 3, 1000], [1, 2, 3, 4], 16, dtype, device="cuda", kv_fp8=True)
    assert case[0].looped.dtype == FP8
    compare(m, OuroFusedLoop(m, use_barrier=barrier), case, atol=atol)


@pytest.mark.parametrize("family", ["tiny-huginn", "tiny-ouro"])
@pytest.mark.parametrize("features", ["off", "on"])
def test_engine_within_the_fp8_bound(family, features):
    """bf16 weights, FP8 KV (what a benchmark gets from EngineConfig(kv_cache_dtype="fp8_e4m3")),
    prompts past the state slab and the default max_model_len, decoded together; features on:
    CUDA graphs, deferred read-back, the fused loop (Ouro) up to 8 rows; off: eager."""
    reference = resolve_model(family, dtype=torch.float32, device="cpu", seed=0)
    model = resolve_model(family, dtype=BF16, device="cuda", seed=0)
    loops = model.default_loop_params.max_loops
    reqs = {f"r{n}": (prompt(n, n, model.vocab_size), fixed_depth(8, n, loops)) for n in (1, 9, 40, *LONG_PROMPTS[:2])}
    extra = {**GPU_FEATURES, "fused_loop_rows": 8} if features == "on" else GPU_PATHS_OFF
    engine = EngineCore(EngineConfig(model=family, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e4m3",
                                     block_size=16, num_blocks=2048, max_model_len=MAX_MODEL_LEN, **extra),
                        model=model)
    assert engine.runner.kv.looped.dtype == FP8
    gap = teacher_forced_gap(reference, reqs, run_engine(engine, reqs))
    print(f"{family} features {features}: FP8 KV teacher-forced gap {gap}")
    if features == "on" and family == "tiny-ouro":
        assert model.fused_loop.runs > 0
    model.use_fused_loop(0)
    bound = BOUNDS[family]
    assert gap.max <= bound.max and gap.mean <= bound.mean, gap
