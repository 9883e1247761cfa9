"""Attention backends: the PyTorch reference (CPU/CI) and Triton (CUDA)."""

from __future__ import annotations

import torch

from loopserve.model.attention.base import AttentionBackend
from loopserve.model.attention.torch_ref import TorchAttention


def get_backend(device: torch.device | str) -> AttentionBackend:
    """Triton on CUDA when available, else the PyTorch reference."""
    if torch.device(device).type == "cuda":
        try:
            from loopserve.model.attention.triton_backend import TritonAttention
        except ImportError:
            return TorchAttention()
        return TritonAttention()
    return TorchAttention()


__all__ = ["AttentionBackend", "TorchAttention", "get_backend"]
