"""The hardware rates a benchmark measures in its own run (a device-to-device copy and a
matmul), and the model's bytes and FLOPs its floors charge at those rates.

The copy rate counts bytes read plus bytes written, so it stands for the memory bandwidth a
kernel that streams weights or K/V gets; the matmul rate is a large square matmul in the
model's dtype.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from loopserve.model.base import LoopedModel


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def device_time(fn: Callable[[], object], device: torch.device, iters: int = 10, warmup: int = 3) -> float:
    """Seconds per call of `fn`: CUDA events around `iters` back-to-back calls on a GPU, the
    host clock on CPU."""
    for _ in range(warmup):
        fn()
    _sync(device)
    if device.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        torch.cuda.synchronize(device)
        return a.elapsed_time(b) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def measure_rates(device: torch.device, dtype: torch.dtype) -> dict[str, float]:
    """{"copy_GBps": bytes read + written per second by a copy, "matmul_TFLOPs": a square
    matmul's rate in `dtype`}: 1 GiB buffers and 8192^3 on a GPU, 64 MiB and 1024^3 on CPU."""
    gpu = device.type == "cuda"
    nbytes, n = (1 << 30, 8192) if gpu else (64 << 20, 1024)
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    copy_s = device_time(lambda: y.copy_(x), device)
    del x, y
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    mm_s = device_time(lambda: a @ b, device, iters=10 if gpu else 3)
    del a, b
    if gpu:
        torch.cuda.empty_cache()
    return {"copy_GBps": 2 * nbytes / copy_s / 1e9, "matmul_TFLOPs": 2 * n**3 / mm_s / 1e12}


def _looped_params(model: LoopedModel) -> list[torch.nn.Parameter]:
    return [p for name, p in model.named_parameters() if ".layers." in name or "core_block" in name]


def weight_bytes_per_token(model: LoopedModel, loops: float | None = None) -> float:
    """Weight bytes one decode step reads: the looped layers once per loop (`loops`, default
    the model's maximum; a mean exit depth with adaptive exit), plus the LM head."""
    looped = sum(p.numel() * p.element_size() for p in _looped_params(model))
    head = model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    return looped * (model.max_loops if loops is None else loops) + head


def prefill_flops(model: LoopedModel, n: int, loops: float | None = None) -> float:
    """FLOPs of one n-token prompt's prefill: the looped layers' matmuls and causal attention
    once per loop, and one row of logits."""
    cfg = model.config
    layer_params = sum(p.numel() for p in _looped_params(model))
    h = cfg.num_attention_heads * cfg.hd
    per_loop = 2 * layer_params * n + model.kv_spec.num_looped_layers * 2 * n * n * h
    return (model.max_loops if loops is None else loops) * per_loop + 2 * model.lm_head.weight.numel()
