"""The host-side batch (one packed copy per Operation) and the runner's token lookup."""

import torch
from hypothesis import given, settings, strategies as st

from loopserve.engine.host_batch import _slots, host_batch
from loopserve.engine.request import Request
from loopserve.intmath import cdiv
from loopserve.model.batch import host_tensor
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.scheduler import Operation


@settings(max_examples=200, deadline=None)
@given(prompt=st.lists(st.integers(0, 99), min_size=1, max_size=20), outs=st.lists(st.integers(0, 99), max_size=5),
       drafts=st.lists(st.integers(0, 99), max_size=3), data=st.data())
def test_tokens_at_equals_token_at_per_position(prompt, outs, drafts, data):
    req = Request("r", prompt, SamplingParams(), 0, None, output_token_ids=list(outs), draft_token_ids=list(drafts))
    n = len(prompt) + len(outs) + len(drafts)
    positions = data.draw(st.one_of(
        st.builds(lambda a, b: list(range(min(a, b), max(a, b))), st.integers(0, n), st.integers(0, n)),
        st.lists(st.integers(0, n - 1), max_size=8)))
    assert req.tokens_at(positions) == [req.token_at(p) for p in positions]


def test_packed_batch_fields_and_graph_padding():
    hb = host_batch(Operation.PRELUDE, [(3, 4), (17,)], [[5], [2, 9]], 16, token_ids=[7, 8, 9], seeds=[1, 1, 2])
    mb = hb.to(torch.device("cpu"))
    assert mb.positions.tolist() == [3, 4, 17] and mb.positions.dtype == torch.int64
    assert mb.attn.slot_mapping.tolist() == [5 * 16 + 3, 5 * 16 + 4, 9 * 16 + 1]
    assert mb.attn.block_tables.dtype == torch.int32 and mb.attn.block_tables.tolist() == [[5, 0], [2, 9]]
    assert mb.attn.context_lens.tolist() == [5, 18] and mb.attn.seg_starts.tolist() == [0, 2, 3]
    assert mb.token_ids.tolist() == [7, 8, 9] and mb.seeds.tolist() == [1, 1, 2] and mb.logits_indices is None
    assert mb.attn.seg_bounds == [(0, 2), (2, 3)] and mb.attn.max_context_len == 18

    dec = host_batch(Operation.RECURRENT, [(3,), (17,)], [[5], [2, 9]], 16, [2, 3], state_in=[7, 4], state_out=[7, 4])
    pad = dec.padded(4, 3, 0, 1)  # the CUDA-graph layout: every field, padding rows inert
    assert pad.nbytes == pad.pack()[0].numel() and hb.nbytes == hb.pack()[0].numel()
    buf = torch.full((pad.nbytes,), 255, dtype=torch.uint8)
    sm = pad.to(torch.device("cpu"), out=buf, max_context_len=128)
    assert sm.attn.slot_mapping.tolist() == [83, 145, -1, -1]
    assert sm.attn.block_tables.tolist() == [[5, 0, 0], [2, 9, 0], [0, 0, 0], [0, 0, 0]]
    assert sm.depths.tolist() == [2, 3, 2, 2] and sm.positions.tolist() == [3, 17, 0, 0]
    assert sm.attn.context_lens.tolist() == [4, 18, 1, 1] and sm.attn.seg_starts.tolist() == [0, 1, 2, 3, 4]
    assert sm.logits_indices.tolist() == [0, 1, 2, 3] and sm.token_ids.tolist() == [0] * 4
    assert sm.state_in.tolist() == [7, 4, 0, 0] and sm.state_out.tolist() == [7, 4, 1, 1]
    assert sm.attn.max_context_len == 128 and sm.attn.positions.data_ptr() == buf.data_ptr() + 5 * 8


@settings(max_examples=200, deadline=None)
@given(bs=st.sampled_from([1, 4, 16]), start=st.integers(0, 70), n=st.integers(1, 60), data=st.data())
def test_slots_of_a_contiguous_run_equal_the_per_position_formula(bs, start, n, data):
    blocks = data.draw(st.permutations(range(cdiv(start + n, bs) + 3)))
    run = tuple(range(start, start + n))
    gappy = sorted(data.draw(st.sets(st.integers(0, start + n - 1), min_size=1, max_size=n)))
    for ps in (run, gappy):
        assert _slots(ps, list(blocks), bs) == [blocks[p // bs] * bs + p % bs for p in ps]


def test_host_tensor_matches_torch_tensor():
    for vals, dtype in (([3, -1, 2 ** 40], torch.int64), ([7, -2], torch.int32), ([], torch.int64), ([0.5], torch.float32)):
        got = host_tensor(vals, dtype)
        assert got.dtype == dtype and torch.equal(got, torch.tensor(vals, dtype=dtype))
