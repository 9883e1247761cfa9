"""The flat token batch every Operation takes, and the loop state carried between them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopserve.scheduler.types import Operation


def device_tensor(values, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list on `device` without stalling the host: on CUDA it is staged in pinned
    memory and copied asynchronously (a pageable copy waits for the GPU's queue to drain,
    so the next batch could not be prepared while this one runs)."""
    return _to_device(torch.tensor(values, dtype=dtype), device)


def _to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


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
    operation: Operation
    positions: torch.Tensor  # [T]
    depths: torch.Tensor  # [T] loop being run (RECURRENT), else 0
    attn: AttnMetadata
    token_ids: torch.Tensor | None = None  # [T] (PRELUDE)
    seeds: torch.Tensor | None = None  # [T] int64 per-row request seed (Huginn initial state)
    logits_indices: torch.Tensor | None = None  # [n] rows whose logits CODA returns

    @property
    def num_rows(self) -> int:
        return int(self.positions.shape[0])


@dataclass
class LoopState:
    """Carried per row: Huginn (state ‖ injection) or Ouro hidden; `aux` = Ouro's Π(1-σ)."""

    hidden: torch.Tensor  # [T, S]
    aux: torch.Tensor  # [T] fp32


def build_attn_metadata(rows_seg: list[int], rows_pos: list[int], seg_blocks: list[list[int]],
                        block_size: int, device: torch.device) -> AttnMetadata:
    """Attention metadata from per-row (segment, position) and each segment's block ids.

    Rows of one segment must be consecutive in the batch. An empty block list means the
    plane does not exist for this Operation (e.g. Ouro's embedding-only PRELUDE): no slots.
    """
    num_segs = len(seg_blocks)
    starts = [0] * (num_segs + 1)
    ctx = [0] * num_segs
    for s, p in zip(rows_seg, rows_pos):
        starts[s + 1] += 1
        ctx[s] = max(ctx[s], p + 1)
    for s in range(num_segs):
        starts[s + 1] += starts[s]
    nblk = [-(-c // block_size) if blocks else 0 for c, blocks in zip(ctx, seg_blocks)]
    for s, (need, have) in enumerate(zip(nblk, seg_blocks)):
        if have and need > len(have):
            raise ValueError(f"segment {s}: context {ctx[s]} needs {need} blocks, table has {len(have)}")
    width = max(nblk, default=0) or 1
    table = torch.zeros(num_segs, width, dtype=torch.int32)
    for s, blocks in enumerate(seg_blocks):
        if nblk[s]:
            table[s, : nblk[s]] = torch.tensor(blocks[: nblk[s]], dtype=torch.int32)
    slots = [seg_blocks[s][p // block_size] * block_size + p % block_size if seg_blocks[s] else -1
             for s, p in zip(rows_seg, rows_pos)]
    return AttnMetadata(
        seg_starts=device_tensor(starts, torch.int64, device),
        block_tables=_to_device(table, device),
        context_lens=device_tensor(ctx, torch.int32, device),
        slot_mapping=device_tensor(slots, torch.int64, device),
        positions=device_tensor(rows_pos, torch.int64, device),
        block_size=block_size,
        max_context_len=max(ctx, default=0),
        seg_bounds=list(zip(starts[:-1], starts[1:])),
        seg_num_blocks=nblk,
        seg_context_lens=ctx,
    )


def fresh_segments(meta: AttnMetadata, min_rows: int) -> list[int]:
    """Segments whose rows are exactly positions 0..n-1 (n >= min_rows): a prompt's first
    chunk with every row still looping. They attend only to their own new K/V, so dense
    causal attention over the rows equals paged attention over the plane."""
    return [s for s, (a, b) in enumerate(meta.seg_bounds)
            if b - a >= min_rows and b - a == meta.seg_context_lens[s]]


def subset(meta: AttnMetadata, segs: list[int]) -> tuple[torch.Tensor, AttnMetadata]:
    """The rows of `segs` (device index) and metadata for just those segments."""
    rows = [r for s in segs for r in range(*meta.seg_bounds[s])]
    starts = [0]
    for s in segs:
        a, b = meta.seg_bounds[s]
        starts.append(starts[-1] + b - a)
    dev = meta.positions.device
    idx = device_tensor(rows, torch.int64, dev)
    sel = device_tensor(segs, torch.int64, dev)
    ctx = [meta.seg_context_lens[s] for s in segs]
    return idx, AttnMetadata(
        seg_starts=device_tensor(starts, torch.int64, dev),
        block_tables=meta.block_tables.index_select(0, sel),
        context_lens=meta.context_lens.index_select(0, sel),
        slot_mapping=meta.slot_mapping.index_select(0, idx),
        positions=meta.positions.index_select(0, idx),
        block_size=meta.block_size, max_context_len=max(ctx, default=0),
        seg_bounds=list(zip(starts[:-1], starts[1:])),
        seg_num_blocks=[meta.seg_num_blocks[s] for s in segs], seg_context_lens=ctx)
