"""Cases for the fused Ouro loop tests (CPU interpreter and GPU): a decode-shaped RECURRENT
batch over a random KV pool, and the fused-vs-per-layer comparison."""

import torch

from loopserve.engine.host_batch import host_batch
from loopserve.model.batch import LoopState
from loopserve.model.paged_kv import FP8, PagedKVCache
from loopserve.scheduler.types import Operation


def make_case(model, positions, depths, block_size, dtype, seed=0, pad_rows=0, device="cpu", first_block=1,
              kv_fp8=False):
    """A decode-shaped RECURRENT batch over a random KV pool (each row its own blocks); pad_rows
    rows as a CUDA-graph batch pads them (slot -1, position 0, block 0). `first_block`: where
    the rows' blocks start (a large one makes a pool past 2^31 elements, zero below the rows').
    `kv_fp8`: an FP8 pool with distinct k and v scales per layer (0.25 (l + 1), 0.5 (l + 1))."""
    g = torch.Generator().manual_seed(seed)
    tables, nxt = [], first_block
    for p in positions:
        n = p // block_size + 1
        tables.append(list(range(nxt, nxt + n)))
        nxt += n
    kv = PagedKVCache(model.kv_spec, block_size, nxt, 0, dtype, torch.device(device), FP8 if kv_fp8 else None)
    if kv_fp8:
        layers = torch.arange(1, model.kv_spec.num_looped_layers + 1, dtype=torch.float32, device=device)
        kv.scales["looped"].copy_(torch.stack([0.25 * layers, 0.5 * layers], dim=1))
    if first_block == 1:
        kv.looped.copy_(torch.randn(kv.looped.shape, generator=g))
    else:
        kv.looped[first_block:] = torch.randn(kv.looped[first_block:].shape, generator=g).to(device, dtype)
    hb = host_batch(Operation.RECURRENT, [[p] for p in positions], tables, block_size, depths)
    if pad_rows:
        hb = hb.padded(len(positions) + pad_rows, hb.width, 0, 0)  # state rows: unused here
    mb = hb.to(torch.device(device))
    t = mb.num_rows
    state = LoopState(torch.randn(t, model.state_dim, generator=g).to(device, dtype),
                      torch.rand(t, generator=g).to(device))
    return kv, mb, state


def compare(model, fused, case, atol):
    """fused's loop == the per-layer path's: hidden, Π(1-σ), score and the K/V pool after (an
    FP8 pool: dequantized, one e4m3 step apart at most)."""
    kv, mb, state = case
    outs = []
    for f in (None, fused):
        pool = PagedKVCache(model.kv_spec, kv.block_size, kv.looped.shape[0], 0, kv.looped.dtype,
                            kv.looped.device, FP8 if kv.quantized else None)
        pool.looped.copy_(kv.looped)
        if kv.quantized:
            pool.scales["looped"].copy_(kv.scales["looped"])
        model.fused_loop = f
        try:
            with torch.inference_mode():
                (st, score) = model.recurrent(mb, LoopState(state.hidden.clone(), state.aux.clone()), pool)
        finally:
            model.fused_loop = None
        outs.append((st, score, pool.looped))
    (ref, ref_score, ref_pool), (got, score, pool) = outs
    torch.testing.assert_close(got.hidden.float(), ref.hidden.float(), atol=atol, rtol=atol)
    torch.testing.assert_close(got.aux, ref.aux, atol=atol, rtol=atol)
    torch.testing.assert_close(score, ref_score, atol=atol, rtol=atol)
    if kv.quantized:
        s = kv.scales["looped"][None, :, :, None, None, None]
        torch.testing.assert_close(pool.float() * s, ref_pool.float() * s, atol=atol, rtol=2 ** -3)
    else:
        torch.testing.assert_close(pool.float(), ref_pool.float(), atol=atol, rtol=atol)
