"""The flat token batch a model forward takes, and the loop state carried between forwards."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch


def device_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on `device` without stalling the host: on CUDA it is staged in pinned
    memory and copied asynchronously (a pageable copy waits for the GPU's queue to drain,
    so the next batch could not be prepared while this one runs)."""
    return to_device(host_tensor(values, dtype), device)


_TYPECODES = {torch.int64: "q", torch.int32: "i"}


def host_tensor(values, dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor of a list; integer lists go through `array` (C speed; torch.tensor walks
    the list object by object, ~0.2 µs per element)."""
    code = _TYPECODES.get(dtype)
    if code is None or not values:
        return torch.tensor(values, dtype=dtype)
    return torch.frombuffer(array(code, values), dtype=dtype)


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on `device`, pinned and asynchronous on CUDA (see device_tensor)."""
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


@dataclass
class AttnMetadata:
    """Rows grouped in segments: one request's rows on one KV plane, ascending positions."""

    seg_starts: torch.Tensor  # [S+1] int64 row offsets
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    context_lens: torch.Tensor  # [S] int32: max position in the segment + 1
    slot_mapping: torch.Tensor  # [T] int64: where each row's K/V is written
    positions: torch.Tensor  # [T] int64
    block_size: int
    max_context_len: int
    seg_bounds: list[tuple[int, int]]  # host copy of seg_starts as (start, end) pairs
    seg_num_blocks: list[int]  # host copy: blocks each segment's context spans
    seg_context_lens: list[int]  # host copy of context_lens


@dataclass
class ModelBatch:
    """What one forward reads; which Operation runs it is the engine's business."""

    positions: torch.Tensor  # [T]
    depths: torch.Tensor  # [T] loop being run (RECURRENT), else 0
    attn: AttnMetadata
    token_ids: torch.Tensor | None = None  # [T] (PRELUDE); -1: the id is in the row's state slab row
    seeds: torch.Tensor | None = None  # [T] int64 per-row request seed (Huginn initial state)
    logits_indices: torch.Tensor | None = None  # [n] rows whose logits CODA returns
    # [T] engine slab rows each row's loop state is read from / written to (the model ignores them)
    state_in: torch.Tensor | None = None
    state_out: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])


@dataclass
class LoopState:
    """Carried per row: Huginn (state ‖ injection) or Ouro hidden; `aux` = Ouro's Π(1-σ)."""

    hidden: torch.Tensor  # [T, S]
    aux: torch.Tensor  # [T] fp32
