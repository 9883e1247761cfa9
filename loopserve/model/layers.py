"""Decoder building blocks (gpt-fast style plain PyTorch).

Attention layers take an `attend(q, k, v, rot) -> o` callable, so the paged engine path and
the dense reference share the layer math but not the KV handling; `rot` is applied to q and k
inside it, where a paged backend can fuse it into the K/V write.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn



class Attend(Protocol):
    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 rot: Rotation | None = None) -> torch.Tensor:
        """Attention of q over k, v after rotating q and k by `rot` (None: already rotated)."""
        ...


def rotating(attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]) -> Attend:
    """An `Attend` from attention over already-rotated q and k (the dense reference's)."""
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rot: Rotation | None = None) -> torch.Tensor:
        return attend(q, k, v) if rot is None else attend(rot(q), rot(k), v)
    return fn


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def _add_rms_norm(x: torch.Tensor, delta: torch.Tensor, delta_weight: torch.Tensor, eps: float,
                  out_weight: torch.Tensor | None, out_eps: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x + rms_norm(delta), and rms_norm of that sum (the next sub-layer's input): one pass."""
    x = x + _rms_norm(delta, delta_weight, eps)
    return x, (None if out_weight is None else _rms_norm(x, out_weight, out_eps))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
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


def _exit_gate_update(logit: torch.Tensor, remaining: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ouro's exit gate: Π(1-σ) after this loop, and the score 1 - Π(1-σ), in fp32."""
    remaining = remaining * (1.0 - torch.sigmoid(logit.float()))
    return remaining, 1.0 - remaining


class _Kernels:
    """The elementwise pieces of every layer: eager by default; `fuse()` swaps in
    torch.compile'd versions (one kernel each instead of 5-15 tiny ones, which dominate a
    decode step on a GPU even under CUDA graphs)."""

    rms_norm = staticmethod(_rms_norm)
    add_rms_norm = staticmethod(_add_rms_norm)
    rope = staticmethod(_rope)
    swiglu = staticmethod(_swiglu)
    exit_gate_update = staticmethod(_exit_gate_update)
    fused = False


def compiled(fn: Callable) -> Callable:
    """torch.compile without fullgraph: past dynamo's recompile limit (new dtypes, 0/1 size
    specialisations, grad modes) a fullgraph function raises mid-step; this one runs eager."""
    return torch.compile(fn, dynamic=True)


def fuse_elementwise() -> None:
    """Compile the elementwise kernels (process-wide, idempotent; CUDA engines opt in)."""
    if _Kernels.fused:
        return
    for name, fn in (("rms_norm", _rms_norm), ("add_rms_norm", _add_rms_norm), ("rope", _rope),
                     ("swiglu", _swiglu), ("exit_gate_update", _exit_gate_update)):
        setattr(_Kernels, name, staticmethod(compiled(fn)))
    _Kernels.fused = True


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Kernels.rms_norm(x, self.weight, self.eps)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, delta_norm: RMSNorm,
                 out_norm: RMSNorm | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(x + delta_norm(delta), out_norm(that)): a sandwich layer's residual and the next
    norm in one kernel when fused."""
    if out_norm is None:
        return _Kernels.add_rms_norm(x, delta, delta_norm.weight, delta_norm.eps, None, 0.0)
    return _Kernels.add_rms_norm(x, delta, delta_norm.weight, delta_norm.eps, out_norm.weight, out_norm.eps)


@dataclass(frozen=True)
class Rotation:
    """RoPE angles of one batch's positions, computed once per Operation and applied in
    every layer (per layer, the trigonometry cost more than the rotation)."""

    cos: torch.Tensor  # [T, 1, D/2] fp32
    sin: torch.Tensor
    interleaved: bool

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> rotated, computed in fp32."""
        return _Kernels.rope(x, self.cos, self.sin, self.interleaved)


class Rope(nn.Module):
    """RoPE from positions; `interleaved` rotates adjacent pairs (Huginn), else halves
    (Llama/Ouro's rotate_half)."""

    def __init__(self, head_dim: int, theta: float, interleaved: bool) -> None:
        super().__init__()
        self.interleaved = interleaved
        # device named: models are built on the meta device (registry._instantiate) and keep buffers
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor) -> Rotation:
        ang = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [T, D/2]
        return Rotation(ang.cos()[:, None, :], ang.sin()[:, None, :], self.interleaved)


class MergedLinear:
    """Linear layers that read one input, run as one matmul (q/k/v, gate/up): at decode
    batch sizes each matmul is a weight-bound GEMV, and one wide GEMV streams weights
    faster than three narrow ones and launches one kernel instead of three.

    The first call concatenates the weights and re-points each layer's parameters at their
    slice of it, so state_dict names, checkpoint loading (in-place copies) and memory stay
    as they were; if the parameters are replaced (`.to()`, a new load) it merges again.
    """

    def __init__(self, *parts: nn.Linear) -> None:
        self.parts = parts
        self.sizes = [p.out_features for p in parts]
        self._ptrs: list[int] = []
        self._weight: torch.Tensor | None = None
        self._bias: torch.Tensor | None = None

    @torch.no_grad()
    def _merge(self) -> None:
        self._weight = torch.cat([p.weight for p in self.parts])
        for p, w in zip(self.parts, self._weight.split(self.sizes)):
            p.weight.data = w
        biases = [p.bias for p in self.parts]
        self._bias = None
        if any(b is not None for b in biases):
            self._bias = torch.cat([b if b is not None else self._weight.new_zeros(n)
                                    for b, n in zip(biases, self.sizes)])
            for p, b in zip(self.parts, self._bias.split(self.sizes)):
                if p.bias is not None:
                    p.bias.data = b
        self._ptrs = self._pointers()

    @torch.no_grad()
    def adopt(self, buffer: torch.Tensor) -> None:
        """Move the merged weight into `buffer` ([sum of out_features, in_features], e.g. one
        layer's slice of a stack of all layers) and re-point the parts there."""
        if any(p.bias is not None for p in self.parts):
            raise ValueError("adopt() moves weights only; these layers have biases")
        buffer.copy_(torch.cat([p.weight for p in self.parts]))
        for p, w in zip(self.parts, buffer.split(self.sizes)):
            p.weight.data = w
        self._weight, self._bias = buffer, None
        self._ptrs = self._pointers()

    def _pointers(self) -> list[int]:
        return [t.data_ptr() for p in self.parts for t in (p.weight, p.bias) if t is not None]

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._pointers() != self._ptrs:
            self._merge()
        return F.linear(x, self._weight, self._bias).split(self.sizes, dim=-1)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return _Kernels.swiglu(gate, up)


def exit_gate_update(logit: torch.Tensor, remaining: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _Kernels.exit_gate_update(logit, remaining)
