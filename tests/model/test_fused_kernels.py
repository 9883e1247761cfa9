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
