"""The compiled elementwise kernels (CUDA engines' fuse_elementwise) on CPU: equal to eager,
and past dynamo's recompile limit they fall back to eager instead of raising mid-step."""

import torch
import torch._dynamo

from loopserve.model import layers


def test_compiled_rms_norm_matches_eager_and_survives_the_recompile_limit():
    torch._dynamo.reset()
    fn = layers.compiled(layers._rms_norm)
    w = torch.randn(16)
    with torch._dynamo.config.patch(recompile_limit=1):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):  # each would recompile
            x = torch.randn(5, 16).to(dtype)
            want = layers._rms_norm(x, w.to(dtype), 1e-6)
            torch.testing.assert_close(fn(x, w.to(dtype), 1e-6), want, atol=1e-2, rtol=1e-2)
    torch._dynamo.reset()


def test_compiled_add_rms_norm_rope_and_exit_gate_match_eager():
    torch._dynamo.reset()
    x, d = torch.randn(7, 32), torch.randn(7, 32)
    wd, wo = torch.rand(32) + 0.5, torch.rand(32) + 0.5
    got = layers.compiled(layers._add_rms_norm)(x, d, wd, 1e-6, wo, 1e-5)
    want = layers._add_rms_norm(x, d, wd, 1e-6, wo, 1e-5)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(want[0], x + layers._rms_norm(d, wd, 1e-6))
    torch.testing.assert_close(want[1], layers._rms_norm(want[0], wo, 1e-5))
    assert layers._add_rms_norm(x, d, wd, 1e-6, None, 0.0)[1] is None
    last = layers.compiled(layers._add_rms_norm)(x, d, wd, 1e-6, None, 0.0)  # a stack's last layer
    torch.testing.assert_close(last[0], want[0])
    assert last[1] is None
    for interleaved in (False, True):
        rot = layers.Rope(16, 10000.0, interleaved)(torch.tensor([0, 3, 5, 100, 7, 8, 9]))
        q = torch.randn(7, 4, 16)
        torch.testing.assert_close(layers.compiled(layers._rope)(q, rot.cos, rot.sin, interleaved), rot(q))
    logit, rem = torch.randn(6).bfloat16(), torch.rand(6)
    got = layers.compiled(layers._exit_gate_update)(logit, rem)
    want = rem * (1 - torch.sigmoid(logit.float()))
    torch.testing.assert_close(got, (want, 1 - want))
    torch._dynamo.reset()


def _linears(bias: tuple[bool, ...]) -> list[torch.nn.Linear]:
    torch.manual_seed(0)
    return [torch.nn.Linear(12, n, bias=b) for n, b in zip((8, 4, 4), bias)]


def test_merged_linear_equals_its_parts_and_keeps_their_parameters():
    parts = _linears((True, False, True))  # a part without bias gets zeros in the merged bias
    x = torch.randn(5, 12)
    want = [p(x) for p in parts]
    merged = layers.MergedLinear(*parts)
    got = merged(x)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    # no second copy: every part's weight is now a slice of one storage, names unchanged
    assert len({p.weight.untyped_storage().data_ptr() for p in parts}) == 1
    # an in-place load into a part (load_state_dict copies) shows in the merged matmul
    new = torch.randn(4, 12)
    parts[1].load_state_dict({"weight": new})
    torch.testing.assert_close(merged(x)[1], x @ new.T)
    # replaced parameters (.to(), a fresh load) are merged again, not silently stale
    for p in parts:
        p.to(torch.float64)
    got64 = merged(x.double())
    torch.testing.assert_close(got64[2], parts[2](x.double()))
    assert got64[0].dtype == torch.float64
