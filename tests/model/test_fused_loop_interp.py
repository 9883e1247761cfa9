"""The fused Ouro loop kernel under TRITON_INTERPRET=1 on CPU: one loop equals the per-layer
path (hidden, exit state, score, the K/V written), weights stay shared after stacking, and an
engine running it keeps the dense reference's greedy tokens. GPU twin: tests/gpu."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the kernels

import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("interpreter tests are for CPU-only machines; tests/gpu covers CUDA", allow_module_level=True)

from loopserve.model.fused_loop import ouro_loop  # noqa: E402
from loopserve.model.fused_loop.ouro_loop import OuroFusedLoop, num_splits, row_tile  # noqa: E402
from loopserve.model.registry import resolve_model  # noqa: E402
from tests.gpu.fused_cases import compare, make_case  # noqa: E402

if not ouro_loop.INTERPRET:
    pytest.skip("kernels were imported before TRITON_INTERPRET was set", allow_module_level=True)


@pytest.fixture(scope="module")
def ouro():
    return resolve_model("tiny-ouro", seed=0)


@pytest.mark.parametrize("programs", [1, 3, 40])
def test_one_loop_equals_the_per_layer_path(ouro, programs):
    """Rows at different depths and contexts (GQA: 4 q heads over 2 kv heads); 40 programs
    give long rows several KV splits, some of them empty."""
    case = make_case(ouro, [5, 0, 300, 9], [1, 2, 3, 1], block_size=4, dtype=torch.float32)
    assert num_splits(4, 2, 40, 301, 64) == 4  # tiny-ouro's KV tile is 64 positions
    compare(ouro, OuroFusedLoop(ouro, num_programs=programs), case, atol=1e-5)


@pytest.mark.parametrize("dtype, block_k", [(torch.float32, 32), (torch.bfloat16, 32), (torch.float32, 128)])
def test_gemv_k_chunks(dtype, block_k):
    """block_k 32 gives every K several chunks, so the chunk loop loads the next chunk past
    the end of K; 128 leaves some K (tiny-ouro's 64) shorter than the first chunk. 3 programs
    own unequal tile counts."""
    m = resolve_model("tiny-ouro", dtype=dtype, seed=0)
    case = make_case(m, [5, 0, 300, 9], [1, 2, 3, 1], block_size=4, dtype=dtype)
    fused = OuroFusedLoop(m, num_programs=3, block_k=block_k)
    compare(m, fused, case, atol=1e-5 if dtype == torch.float32 else 5e-2)


def test_padding_rows_write_no_kv(ouro):
    """A graph-padded batch: the padding rows' outputs are dropped and they write nothing."""
    case = make_case(ouro, [7, 2, 11], [1, 1, 2], block_size=8, dtype=torch.float32, pad_rows=1)
    compare(ouro, OuroFusedLoop(ouro, num_programs=2), case, atol=1e-5)


def test_bf16_storage(ouro):
    m = resolve_model("tiny-ouro", dtype=torch.bfloat16, seed=0)
    case = make_case(m, [3, 40], [1, 2], block_size=4, dtype=torch.bfloat16)
    compare(m, OuroFusedLoop(m, num_programs=2), case, atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_cache(dtype):
    """An FP8 pool with per-layer k and v scales: the fused loop quantizes its new K/V and
    dequantizes the range as the per-layer path does."""
    m = resolve_model("tiny-ouro", dtype=dtype, seed=0)
    case = make_case(m, [5, 0, 300, 9], [1, 2, 3, 1], block_size=4, dtype=dtype, kv_fp8=True)
    compare(m, OuroFusedLoop(m, num_programs=3), case, atol=1e-4 if dtype == torch.float32 else 5e-2)


def test_stacking_shares_storage_and_follows_new_weights():
    m = resolve_model("tiny-ouro", seed=1)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    fused = OuroFusedLoop(m, num_programs=2)
    st = fused.stacked()
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    layer = m.model.layers[1]
    assert layer.self_attn.k_proj.weight.data_ptr() == st.qkv[1, layer.self_attn.h * layer.self_attn.hd:].data_ptr()
    assert layer.post_attention_layernorm_2.weight.data_ptr() == st.norms[1, 3 * m.config.hidden_size:].data_ptr()
    ptr = layer.self_attn.qkv._weight.data_ptr()
    with torch.inference_mode():  # the unfused path does not merge again: it reads the stack
        layer.self_attn.qkv(torch.zeros(1, m.config.hidden_size))
    assert layer.self_attn.qkv._weight.data_ptr() == ptr == st.qkv[1].data_ptr()
    m.load_state_dict({k: v * 0.5 for k, v in before.items()})  # in place: the stack sees it
    assert fused.stacked() is st and torch.equal(st.down[0], before["model.layers.0.mlp.down_proj.weight"] * 0.5)
    layer.mlp.down_proj.weight = torch.nn.Parameter(torch.ones_like(layer.mlp.down_proj.weight))
    assert fused.stacked() is not st  # a replaced parameter: stacked again
    assert torch.equal(fused.stacked().down[1], torch.ones_like(st.down[1]))
    case = make_case(m, [6, 13], [1, 2], block_size=4, dtype=torch.float32)
    compare(m, fused, case, atol=1e-5)


def test_row_tile_balances_programs():
    assert row_tile(2048, 132) == 16  # 128 tiles: one each
    assert row_tile(11264, 132) == 8  # 16-row tiles leave the busiest program 96 rows, 8-row 88
    assert row_tile(6144, 132) == 16


def test_rejects_bad_settings(ouro):
    with pytest.raises(ValueError, match="max_rows=0 must be in"):
        OuroFusedLoop(ouro, max_rows=0)
    with pytest.raises(ValueError, match="use_barrier needs concurrent programs"):
        OuroFusedLoop(ouro, use_barrier=True)


def test_engine_with_fused_loop_matches_dense_reference():
    """Decode steps through the fused kernel (prompt batches through the per-layer path)."""
    from tests.engine.conftest import make_engine, reference, run_to_completion, workload

    engine = make_engine("tiny-ouro", fused_loop="on", fused_loop_rows=4)
    assert engine.model.fused_loop is not None
    work = workload(seed=3, n=3, max_tokens=4)
    for rid, prompt, params in work:
        engine.add_request(prompt, params, request_id=rid)
    outs, depths = run_to_completion(engine)
    assert engine.model.fused_loop.runs > 0
    engine.model.use_fused_loop(0)
    for rid, prompt, params in work:
        tokens, ref_depths = reference("tiny-ouro", prompt, params)
        assert outs[rid] == list(tokens), f"{rid}: tokens differ"
        assert depths[rid] == list(ref_depths), f"{rid}: exit depths differ"


def test_weights_do_not_move_once_the_engine_is_built():
    """CUDA graphs capture weight addresses: stacking the fused loop's weights at its first
    batch-1 loop, after batch-2 graphs of the per-layer path were captured, freed the storage
    those graphs read (an illegal memory access on the H200). Batches of 2 rows run first here."""
    from tests.engine.conftest import make_engine, run_to_completion
    from loopserve.protocol.sampling_params import SamplingParams

    engine = make_engine("tiny-ouro", fused_loop="on", fused_loop_rows=1)
    try:
        def pointers():
            return {n: p.data_ptr() for n, p in engine.model.named_parameters()}

        built = pointers()
        params = SamplingParams(max_tokens=3, ignore_eos=True, max_loops=2, exit_threshold=1.0)
        for rid, n in (("a", 5), ("b", 7)):
            engine.add_request(list(range(1, n + 1)), params, request_id=rid)
        run_to_completion(engine)  # prompts, batch-2 decode
        engine.add_request([3, 4], params, request_id="c")
        run_to_completion(engine)  # batch-1 decode: the fused loop
        assert engine.model.fused_loop.runs > 0
        assert pointers() == built
    finally:
        engine.model.use_fused_loop(0)


def test_engine_with_fused_loop_at_long_contexts():
    """Decode rows at contexts past the state slab and 2048 positions (tests/real_shapes.py)
    in one fused batch: many KV splits per row, the dense reference's tokens. One decode
    token: the interpreter is slow."""
    from dataclasses import replace

    from tests.engine.conftest import make_engine, reference, run_to_completion
    from tests.real_shapes import ENGINE, LONG_PROMPTS, workload

    engine = make_engine("tiny-ouro", **ENGINE, fused_loop="on", fused_loop_rows=4)
    items = [replace(it, params=replace(it.params, max_tokens=2))
             for it in workload((LONG_PROMPTS[0], LONG_PROMPTS[-1]))]
    for it in items:
        engine.add_request(it.prompt, it.params, request_id=it.request_id)
    outs, depths = run_to_completion(engine)
    assert engine.model.fused_loop.runs > 0
    engine.model.use_fused_loop(0)
    for it in items:
        want = reference("tiny-ouro", it.prompt, it.params)
        assert (outs[it.request_id], depths[it.request_id]) == tuple(map(list, want)), it.request_id
