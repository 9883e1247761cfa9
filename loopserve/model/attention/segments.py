"""Attention segment helpers: picking a batch's segments and the metadata of just those."""

from __future__ import annotations

import torch

from loopserve.model.batch import AttnMetadata, device_tensor


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
