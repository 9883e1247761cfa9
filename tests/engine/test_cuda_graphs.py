"""The CUDA-graph decode path's CPU twin: decode-shaped batches go through the padded static
buffers (padding rows write no KV, their outputs are dropped), and greedy tokens and exit
depths still equal the dense full-recompute reference. Capture itself is tested in tests/gpu."""

import pytest

from tests.engine.conftest import make_engine, reference, run_to_completion, workload


@pytest.mark.parametrize("policy", ["refill", "no_refill"])
def test_padded_decode_path_matches_dense_reference(family, policy):
    e = make_engine(family, policy=policy, max_num_seqs=6)  # buckets 1, 2, 4, 6: odd sizes pad
    e.runner.use_graphs(6, 128 // 4, capture=False)
    work = workload(seed=3, n=9)
    outs, depths = run_to_completion(e, arrivals=work, every=2)
    assert e.runner.graphs.runs > 0
    for rid, prompt, params in work:
        assert (outs[rid], depths[rid]) == reference(family, prompt, params), rid
