"""The interface every looped model family implements: exactly three Operations."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from loopserve.model.attention import get_backend
from loopserve.model.attention.torch_ref import attend
from loopserve.model.batch import LoopState, ModelBatch
from loopserve.model.layers import Attend, rotating
from loopserve.model.paged_kv import KVSpec, PagedKVCache


@dataclass(frozen=True)
class LoopParams:
    min_loops: int
    max_loops: int
    exit_threshold: float


class LoopedModel(nn.Module):
    """prelude(batch, kv) -> LoopState; recurrent(batch, state, kv) -> (LoopState, score);
    coda(batch, state, kv) -> logits of batch.logits_indices. No call decides scheduling."""

    kv_spec: KVSpec
    state_dim: int
    vocab_size: int
    max_loops: int
    default_loop_params: LoopParams
    coda_writes_kv: bool

    def __init__(self) -> None:
        super().__init__()
        self._backend = None

    def use_fused_loop(self, max_rows: int) -> bool:
        """Run decode batches of up to `max_rows` rows (0: none) through a fused loop kernel
        where the family has one; returns whether it does."""
        return False

    def kv_planes(self, max_loops: int) -> int:
        """Looped-layer KV planes a request with `max_loops` needs (one per depth by default)."""
        return max_loops

    def plane_of_depth(self, depth: int) -> int:
        """The 1-based plane loop `depth` reads and writes."""
        return depth

    def prefix_cache_seeded(self) -> bool | None:
        """Whether a prompt token's K/V (every plane, exit decisions included) depends on the
        request's seed besides its prefix, the model and the loop parameters (then the seed is
        part of its prefix-cache key). None: it depends on more than that, so the engine does
        not cache it."""
        return False

    def paged_attend(self, batch: ModelBatch, kv: PagedKVCache, kind: str, layer: int,
                     scale: float, window: int | None = None) -> Attend:
        """An `attend` that writes this layer's K/V into the paged cache and reads it back."""
        if self._backend is None:
            self._backend = get_backend(kv.looped.device)
        cache, kv_scale = kv.layer_view(kind, layer), kv.layer_scale(kind, layer)
        return lambda q, k, v, rot=None: self._backend.forward(q, k, v, cache, batch.attn, scale, window, rot,
                                                               kv_scale)

    # Operations (implemented by each family)
    def prelude(self, batch: ModelBatch, kv: PagedKVCache) -> LoopState:
        raise NotImplementedError

    def recurrent(self, batch: ModelBatch, state: LoopState, kv: PagedKVCache) -> tuple[LoopState, torch.Tensor]:
        raise NotImplementedError

    def coda(self, batch: ModelBatch, state: LoopState, kv: PagedKVCache) -> torch.Tensor:
        raise NotImplementedError


def dense_attend(positions: torch.Tensor, scale: float, window: int | None = None) -> Attend:
    """Plain causal attention over a whole sequence (the dense reference's path)."""
    return rotating(lambda q, k, v: attend(q, k, v, positions, positions, scale, window))
