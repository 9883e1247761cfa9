"""Decoder building blocks (gpt-fast style plain PyTorch).

Attention layers take an `attend(q, k, v) -> o` callable, so the paged engine path and the
dense reference share the layer math but not the KV handling.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, interleaved: bool) -> torch.Tensor:
    ang = positions.float()[:, None] * inv_freq[None, :]  # [T, D/2]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        a, b = xf[..., :half], xf[..., half:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return out.to(x.dtype)


def _swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class _Kernels:
    """The elementwise pieces of every layer: eager by default; `fuse()` swaps in
    torch.compile'd versions (one kernel each instead of 5-15 tiny ones, which dominate a
    decode step on a GPU even under CUDA graphs)."""

    rms_norm = staticmethod(_rms_norm)
    rope = staticmethod(_rope)
    swiglu = staticmethod(_swiglu)
    fused = False


def compiled(fn: Callable) -> Callable:
    """torch.compile without fullgraph: past dynamo's recompile limit (new dtypes, 0/1 size
    specialisations, grad modes) a fullgraph function raises mid-step; this one runs eager."""
    return torch.compile(fn, dynamic=True)


def fuse_elementwise() -> None:
    """Compile the elementwise kernels (process-wide, idempotent; CUDA engines opt in)."""
    if _Kernels.fused:
        return
    for name, fn in (("rms_norm", _rms_norm), ("rope", _rope), ("swiglu", _swiglu)):
        setattr(_Kernels, name, staticmethod(compiled(fn)))
    _Kernels.fused = True


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Kernels.rms_norm(x, self.weight, self.eps)


class Rope(nn.Module):
    """RoPE computed from positions; `interleaved` rotates adjacent pairs (Huginn), else
    halves (Llama/Ouro's rotate_half)."""

    def __init__(self, head_dim: int, theta: float, interleaved: bool) -> None:
        super().__init__()
        self.interleaved = interleaved
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> rotated, computed in fp32."""
        return _Kernels.rope(x, positions, self.inv_freq.to(x.device), self.interleaved)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _Kernels.swiglu(gate, up)
