"""Attention metadata from per-row (segment, position): kernel tests and benchmarks."""

from __future__ import annotations

import torch

from loopserve.engine.host_batch import host_batch
from loopserve.model.batch import AttnMetadata
from loopserve.scheduler.types import Operation


def build_attn_metadata(rows_seg: list[int], rows_pos: list[int], seg_blocks: list[list[int]],
                        block_size: int, device: torch.device) -> AttnMetadata:
    """Attention metadata on `device` from per-row (segment, position), a segment's rows
    consecutive (kernel tests and benchmarks)."""
    seg_positions: list[list[int]] = [[] for _ in seg_blocks]
    for seg, pos in zip(rows_seg, rows_pos):
        seg_positions[seg].append(pos)
    return host_batch(Operation.RECURRENT, seg_positions, seg_blocks, block_size).to(device).attn
