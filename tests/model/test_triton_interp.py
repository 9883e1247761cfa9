"""The Triton attention kernels under TRITON_INTERPRET=1 on CPU, against the torch reference.

Small shapes only (the interpreter runs every program in numpy). The GPU twin with real
sizes is tests/gpu/test_triton_attention.py.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of the kernels

import pytest
import torch

pytest.importorskip("triton")
if torch.cuda.is_available():
    pytest.skip("interpreter tests are for CPU-only machines; tests/gpu covers CUDA",
                allow_module_level=True)

from loopserve.model.attention import triton_backend  # noqa: E402
from loopserve.model.attention.triton_backend import TritonAttention  # noqa: E402
from tests.attn_metadata import build_attn_metadata  # noqa: E402
from loopserve.model.layers import Rope  # noqa: E402
from tests.gpu.attn_cases import assert_matches, make_case, random_segments  # noqa: E402

if not triton_backend._INTERPRET:
    pytest.skip("kernels were imported before TRITON_INTERPRET was set", allow_module_level=True)


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_decode_mixed_context_lengths(block_size):
    case = make_case([[0], [5], [17], [33], [2], [40]], hq=4, hkv=2, head_dim=16,
                     block_size=block_size, dtype=torch.float32, device="cpu")
    assert_matches(case, TritonAttention())


def test_prefill_gappy_positions_mixed_depths_gqa():
    # one request's chunk at depths 1 and 2 (same positions, own tables), rows not yet exited
    # leave gaps; another request's prompt chunk; a decode row. Non-power-of-two head dim.
    chunk = [8, 9, 11, 12, 15, 19, 20]
    segs = [chunk, chunk[1:4], list(range(3, 30)), [44]]
    case = make_case(segs, hq=8, hkv=2, head_dim=24, block_size=4, dtype=torch.float32,
                     device="cpu", strided_q=True)
    assert_matches(case, TritonAttention())


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_batches(seed):
    case = make_case(random_segments(seed, 5, 70, 12), hq=6, hkv=2, head_dim=16, block_size=8,
                     dtype=torch.float32, device="cpu", seed=seed)
    assert_matches(case, TritonAttention())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_storage(dtype):
    case = make_case(random_segments(3, 4, 50, 9), hq=4, hkv=1, head_dim=32, block_size=16,
                     dtype=dtype, device="cpu", seed=3)
    assert_matches(case, TritonAttention())


def test_sliding_window():
    case = make_case(random_segments(4, 4, 80, 10), hq=4, hkv=2, head_dim=16, block_size=4,
                     dtype=torch.float32, device="cpu", seed=4)
    assert_matches(case, TritonAttention(), window=7)


@pytest.mark.parametrize("splits", [2, 5])
def test_split_kv(splits):
    # more splits than a short context fills leaves some splits empty: the merge must skip them
    case = make_case(random_segments(5, 4, 150, 6), hq=4, hkv=2, head_dim=16, block_size=8,
                     dtype=torch.float32, device="cpu", seed=5)
    assert_matches(case, TritonAttention(kv_splits=splits))
    assert_matches(case, TritonAttention(kv_splits=splits), window=40)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fresh_prompt_segments_take_sdpa_the_rest_the_paged_kernel(dtype):
    """Fresh prompts (rows 0..n-1) and the rest of a mixed batch (a gappy chunk whose row 2
    exited, a later chunk, decode rows, a short fresh prompt) in one forward."""
    from loopserve.model.attention.segments import fresh_segments

    segs = [list(range(9)), [0, 1, 3, 4, 5, 6], [17], list(range(6, 14)), list(range(12)), [0, 1], [30]]
    case = make_case(segs, hq=8, hkv=2, head_dim=16, block_size=4, dtype=dtype, device="cpu",
                     strided_q=True)
    assert fresh_segments(case.meta, 4) == [0, 4]
    assert_matches(case, TritonAttention(dense_prefill_rows=4))
    only_fresh = make_case([list(range(7)), list(range(5))], hq=4, hkv=4, head_dim=16,
                           block_size=4, dtype=dtype, device="cpu")
    assert_matches(only_fresh, TritonAttention(dense_prefill_rows=4))


@pytest.mark.parametrize("rope", ["half", "interleaved"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_fused_into_the_kv_write(rope, dtype):
    """q, k unrotated (strided slices of one projection): the fused RoPE + slot write, then
    attention, equals rotate-then-write-then-attend; fresh prompts (SDPA) need the rotated k."""
    segs = [list(range(9)), [0, 1, 3, 4, 5, 6], [17], list(range(12)), [30]]
    case = make_case(segs, hq=8, hkv=2, head_dim=16, block_size=4, dtype=dtype, device="cpu",
                     strided_q=True, rope=rope)
    assert_matches(case, TritonAttention(dense_prefill_rows=4))
    assert_matches(case, TritonAttention(dense_prefill_rows=None))


def test_rejects_bad_input():
    case = make_case([[3], [9]], hq=4, hkv=2, head_dim=16, block_size=4, dtype=torch.float32,
                     device="cpu")
    attn, cache = TritonAttention(), case.pool[:, 0]
    with pytest.raises(ValueError, match="Hq=3 is not a multiple of Hkv=2"):
        attn.forward(case.q[:, :3], case.k, case.v, cache, case.meta, case.scale)
    with pytest.raises(ValueError, match="window=0 must be >= 1"):
        attn.forward(case.q, case.k, case.v, cache, case.meta, case.scale, window=0)
    with pytest.raises(ValueError, match="q dtype torch.float64 not supported"):
        attn.forward(case.q.double(), case.k, case.v, cache, case.meta, case.scale)
    with pytest.raises(ValueError, match=r"k shape \(2, 1, 16\) != \(T, Hkv, D\)"):
        attn.forward(case.q, case.k[:, :1], case.v, cache, case.meta, case.scale)
    meta3 = build_attn_metadata([0], [2], [[0]], 3, torch.device("cpu"))
    cache3 = torch.zeros(2, 2, 3, 2, 16)
    with pytest.raises(ValueError, match="block_size=3 must be a power of two in"):
        attn.forward(case.q[:1], case.k[:1], case.v[:1], cache3, meta3, case.scale)
    with pytest.raises(ValueError, match="kv_splits=0 must be in"):
        TritonAttention(kv_splits=0)
    rot = Rope(16, 10000.0, False)(torch.tensor([3]))
    with pytest.raises(ValueError, match=r"rot.cos must be fp32 \(2, 1, 8\)"):
        attn.forward(case.q, case.k, case.v, cache, case.meta, case.scale, rot=rot)


@pytest.mark.parametrize("write", ["triton", "torch"])
def test_padding_rows_with_slot_minus_one_write_nothing(write):
    """CUDA-graph batches pad with slot -1 rows: both KV writers skip them."""
    from dataclasses import replace

    from loopserve.model.attention.base import write_kv
    from loopserve.model.attention.triton_kv_write import triton_write_kv

    torch.manual_seed(0)
    cache = torch.randn(6, 2, 4, 2, 8)
    meta = build_attn_metadata([0, 1, 2], [1, 5, 0], [[3], [1, 2], [4]], 4, torch.device("cpu"))
    meta = replace(meta, slot_mapping=torch.tensor([13, -1, -1]))
    k, v = torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    want = cache.clone()
    want[3, 0, 1], want[3, 1, 1] = k[0], v[0]
    (triton_write_kv if write == "triton" else write_kv)(cache, meta, k, v)
    assert torch.equal(cache, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [None, 3])
def test_fp8_cache_decode_and_prefill(dtype, splits):
    """An FP8 pool (k_scale 0.5, v_scale 2): the write kernel quantizes (clamping values past
    e4m3's range), the paged kernel dequantizes; both equal the torch path on the same pool."""
    from tests.gpu.attn_cases import FP8_SCALES

    case = make_case(random_segments(6, 5, 90, 10), hq=4, hkv=2, head_dim=16, block_size=8,
                     dtype=dtype, device="cpu", seed=6, kv_scales=FP8_SCALES)
    assert_matches(case, TritonAttention(kv_splits=splits))


@pytest.mark.parametrize("rope", [None, "half"])
def test_fp8_cache_fresh_prompts_and_fused_rope(rope):
    """SDPA's fresh prompt rows read K/V rounded as the FP8 plane holds it; RoPE fused into
    the quantizing write."""
    from tests.gpu.attn_cases import FP8_SCALES

    segs = [list(range(9)), [0, 1, 3, 4, 5, 6], [17], list(range(12)), [30]]
    case = make_case(segs, hq=8, hkv=2, head_dim=16, block_size=4, dtype=torch.bfloat16, device="cpu",
                     strided_q=True, rope=rope, kv_scales=FP8_SCALES)
    assert_matches(case, TritonAttention(dense_prefill_rows=4))
    assert_matches(case, TritonAttention(dense_prefill_rows=None))


def test_fp8_cache_needs_its_scales():
    from tests.gpu.attn_cases import FP8_SCALES

    case = make_case([[3], [9]], hq=4, hkv=2, head_dim=16, block_size=4, dtype=torch.float32,
                     device="cpu", kv_scales=FP8_SCALES)
    cache = case.pool[:, 0]
    with pytest.raises(ValueError, match="kv_scale must be given exactly for an FP8 cache"):
        TritonAttention().forward(case.q, case.k, case.v, cache, case.meta, case.scale)
    with pytest.raises(ValueError, match=r"kv_scale must be a contiguous fp32 \[2\]"):
        TritonAttention().forward(case.q, case.k, case.v, cache, case.meta, case.scale,
                                  kv_scale=case.kv_scale.double())


FMA_CONTEXTS = [1, 2, 15, 16, 17, 63, 64, 65, 300, 1000]  # within, at and past a block's end


def launched(spies) -> dict[str, int]:
    return {name: spy.launches for name, spy in spies.items()}


@pytest.mark.parametrize("head_dim", [128, 96])
@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_decode_one_head_per_kv_head_takes_the_fma_kernel(head_dim, splits, monkeypatch):
    """FP8 cache, G = 1, one row per segment: `_decode_fma_kernel` (4 splits leave the short
    contexts' later splits empty: the merge must skip them)."""
    from tests.gpu.attn_cases import FP8_SCALES, count_attention_launches

    case = make_case([[c - 1] for c in FMA_CONTEXTS], hq=2, hkv=2, head_dim=head_dim, block_size=16,
                     dtype=torch.bfloat16, device="cpu", seed=7, kv_scales=FP8_SCALES)
    spies = count_attention_launches(monkeypatch)
    assert_matches(case, TritonAttention(kv_splits=splits))
    assert launched(spies) == {"fma": 1, "dot": 0}


@pytest.mark.parametrize("splits", [1, 4])
def test_fp8_decode_fma_kernel_sliding_window(splits, monkeypatch):
    """A window of 40 (shorter and longer than the contexts), q strided as a fused projection's."""
    from tests.gpu.attn_cases import FP8_SCALES, count_attention_launches

    case = make_case([[c - 1] for c in FMA_CONTEXTS], hq=3, hkv=3, head_dim=32, block_size=8,
                     dtype=torch.float32, device="cpu", seed=8, strided_q=True, kv_scales=FP8_SCALES)
    spies = count_attention_launches(monkeypatch)
    assert_matches(case, TritonAttention(kv_splits=splits), window=40)
    assert launched(spies) == {"fma": 1, "dot": 0}


def test_other_batches_keep_the_dot_kernel(monkeypatch):
    """G = 2, a prefill segment among decode rows, or a bf16 cache: `_paged_attn_kernel`; fresh
    prompts go to SDPA and the decode rows left over to the FMA kernel."""
    from tests.gpu.attn_cases import FP8_SCALES, count_attention_launches

    decode = [[c - 1] for c in (1, 17, 65, 200)]
    cases = [
        (make_case(decode, hq=4, hkv=2, head_dim=32, block_size=16, dtype=torch.bfloat16, device="cpu",
                   kv_scales=FP8_SCALES), TritonAttention(kv_splits=2), {"fma": 0, "dot": 1}),
        (make_case([*decode, [30, 31, 33]], hq=2, hkv=2, head_dim=32, block_size=16, dtype=torch.bfloat16,
                   device="cpu", kv_scales=FP8_SCALES), TritonAttention(kv_splits=2), {"fma": 0, "dot": 1}),
        (make_case(decode, hq=2, hkv=2, head_dim=32, block_size=16, dtype=torch.bfloat16, device="cpu"),
         TritonAttention(), {"fma": 0, "dot": 1}),
        (make_case([list(range(9)), *decode], hq=2, hkv=2, head_dim=32, block_size=16, dtype=torch.bfloat16,
                   device="cpu", kv_scales=FP8_SCALES), TritonAttention(dense_prefill_rows=4),
         {"fma": 1, "dot": 0}),
    ]
    for case, backend, want in cases:
        spies = count_attention_launches(monkeypatch)
        assert_matches(case, backend)
        assert launched(spies) == want
