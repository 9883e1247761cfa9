"""Triton paged attention on CUDA against the torch reference, at model-like sizes."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)  # keep the kernels un-imported on CPU

from loopserve.model.attention import get_backend  # noqa: E402
from loopserve.model.attention.triton_backend import TritonAttention, launch_config  # noqa: E402
from tests.gpu.attn_cases import assert_matches, make_case, random_segments  # noqa: E402

BF16 = torch.bfloat16


def test_cuda_picks_triton():
    assert isinstance(get_backend("cuda"), TritonAttention)


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_decode_mixed_context_lengths(block_size):
    ctx = [1, 2, 15, 16, 17, 63, 64, 65, 1000, 2047, 3000] * 6
    case = make_case([[c - 1] for c in ctx], hq=32, hkv=8, head_dim=128, block_size=block_size,
                     dtype=BF16, device="cuda")
    assert_matches(case, TritonAttention())


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_prefill_chunks_mixed_depths(block_size):
    # a 1k prompt; a later chunk of another request at depths 1 and 2 (own tables) with gaps
    # where rows exited; decode rows in the same batch
    chunk = [p for p in range(512, 1400) if p % 7]
    segs = [list(range(1024)), chunk, chunk[::3], [77], [2900]]
    case = make_case(segs, hq=32, hkv=8, head_dim=128, block_size=block_size, dtype=BF16,
                     device="cuda")
    assert_matches(case, TritonAttention())


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_random_batches(seed):
    case = make_case(random_segments(seed, 24, 2500, 300), hq=16, hkv=4, head_dim=128,
                     block_size=16, dtype=BF16, device="cuda", seed=seed)
    assert_matches(case, TritonAttention())


@pytest.mark.parametrize("hq,hkv,head_dim", [(8, 8, 64), (64, 8, 128), (40, 5, 96)])
def test_group_sizes_and_head_dims(hq, hkv, head_dim):
    case = make_case(random_segments(7, 10, 1500, 200), hq=hq, hkv=hkv, head_dim=head_dim,
                     block_size=16, dtype=BF16, device="cuda", seed=7, strided_q=True)
    assert_matches(case, TritonAttention())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_storage_dtypes(dtype):
    case = make_case(random_segments(8, 12, 1200, 150), hq=16, hkv=4, head_dim=128,
                     block_size=16, dtype=dtype, device="cuda", seed=8)
    assert_matches(case, TritonAttention())


def test_small_decode_batch_splits_kv():
    case = make_case([[3999], [2500]], hq=32, hkv=8, head_dim=128, block_size=16, dtype=BF16,
                     device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert launch_config(case.meta, group=4, num_kv_heads=8, num_sms=sms).num_splits > 1
    assert_matches(case, TritonAttention())


def test_sliding_window():
    case = make_case(random_segments(9, 12, 2000, 300), hq=16, hkv=4, head_dim=128,
                     block_size=16, dtype=BF16, device="cuda", seed=9)
    assert_matches(case, TritonAttention(), window=256)
    assert_matches(case, TritonAttention(kv_splits=4), window=256)


@pytest.mark.parametrize("rope", ["half", "interleaved"])
@pytest.mark.parametrize("hq,hkv,head_dim", [(16, 16, 128), (40, 5, 96)])
def test_rope_fused_into_the_kv_write(rope, hq, hkv, head_dim):
    segs = [list(range(300)), [255], [2047], list(range(0, 700, 3))]
    case = make_case(segs, hq=hq, hkv=hkv, head_dim=head_dim, block_size=16, dtype=BF16, device="cuda",
                     seed=11, strided_q=True, rope=rope)
    assert_matches(case, TritonAttention())
    assert_matches(case, TritonAttention(dense_prefill_rows=None))


@pytest.mark.parametrize("rope", [None, "half"])
def test_pool_past_two_to_the_31_elements(rope):
    """Block id x block stride past 2^31 elements (a large pool's upper blocks, as a 48 GiB
    pool of the 1.4B shape has): the K/V write (plain and with RoPE fused in) and the paged
    attention address them in 64 bits."""
    per_block = 2 * 2 * 16 * 8 * 128  # layers, K/V, block_size, Hkv, head_dim
    skip = (1 << 31) // per_block + 64
    case = make_case([[c - 1] for c in (1, 17, 300, 2049)] + [list(range(700))], hq=32, hkv=8,
                     head_dim=128, block_size=16, dtype=BF16, device="cuda", seed=12,
                     strided_q=rope is not None, rope=rope, skip_blocks=skip)
    assert case.meta.slot_mapping.min().item() // 16 * per_block > 1 << 31  # every row's slot
    assert_matches(case, TritonAttention())
