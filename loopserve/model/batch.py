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


@dataclass
class HostBatch:
    """A ModelBatch's integer fields as host lists, before their one copy to the device.

    Building on the host and moving everything in one pinned transfer (not one per field)
    saves a host-to-device launch and a pinned staging per field on every Operation; the
    CUDA-graph path pads it and copies it straight into its static buffers.
    """

    operation: Operation
    seg_starts: list[int]  # [S+1]
    positions: list[int]  # [T]
    slot_mapping: list[int]  # [T]
    depths: list[int]  # [T]
    context_lens: list[int]  # [S]
    block_tables: list[int]  # [S * width], row-major, padded with 0
    width: int
    block_size: int
    seg_num_blocks: list[int]
    token_ids: list[int] | None = None
    seeds: list[int] | None = None
    logits_indices: list[int] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.positions)

    @property
    def num_segs(self) -> int:
        return len(self.context_lens)

    def padded(self, rows: int, width: int) -> HostBatch:
        """A decode-shaped batch (one row per segment) padded to `rows` rows and a table
        `width`, every optional field present: the CUDA-graph buffers' fixed layout. Padding
        rows are harmless: position 0, slot -1 (no K/V write), a table of block 0 (read only),
        the first row's depth, and their outputs are dropped."""
        t, pad = self.num_rows, rows - self.num_rows
        table = []
        for s in range(t):
            table += self.block_tables[s * self.width:(s + 1) * self.width] + [0] * (width - self.width)
        return HostBatch(
            self.operation, list(range(rows + 1)), self.positions + [0] * pad, self.slot_mapping + [-1] * pad,
            self.depths + self.depths[:1] * pad, self.context_lens + [1] * pad, table + [0] * (pad * width),
            width, self.block_size, self.seg_num_blocks + [1] * pad,
            (self.token_ids or [0] * t) + [0] * pad, (self.seeds or [0] * t) + [0] * pad, list(range(rows)))

    def pack(self) -> tuple[torch.Tensor, list[tuple[str, int, torch.dtype]]]:
        """(bytes on the host, [(field, length, dtype)]): int64 fields first, then int32, so
        every field's view of the bytes is aligned."""
        names64 = ["seg_starts", "positions", "slot_mapping", "depths"] + [
            n for n in ("token_ids", "seeds", "logits_indices") if getattr(self, n) is not None]
        v64 = [x for n in names64 for x in getattr(self, n)]
        v32 = self.context_lens + self.block_tables
        host = torch.cat([torch.tensor(v64, dtype=torch.int64).view(torch.uint8),
                          torch.tensor(v32, dtype=torch.int32).view(torch.uint8)])
        fields = [(n, len(getattr(self, n)), torch.int64) for n in names64]
        fields += [("context_lens", self.num_segs, torch.int32), ("block_tables", len(self.block_tables), torch.int32)]
        return host, fields

    def to(self, device: torch.device, out: torch.Tensor | None = None,
           max_context_len: int | None = None) -> ModelBatch:
        """The ModelBatch on `device` from one copy (into `out` if given: a buffer of exactly
        the packed size). `max_context_len` overrides the launch bound (graph buckets)."""
        host, fields = self.pack()
        if out is None:
            dev = _to_device(host, device)
        else:
            out.copy_(host.pin_memory() if out.device.type == "cuda" else host, non_blocking=True)
            dev = out
        views, off = {}, 0
        for name, n, dtype in fields:
            size = n * dtype.itemsize
            views[name] = dev[off:off + size].view(dtype)
            off += size
        starts = self.seg_starts
        attn = AttnMetadata(
            seg_starts=views["seg_starts"], block_tables=views["block_tables"].view(self.num_segs, self.width),
            context_lens=views["context_lens"], slot_mapping=views["slot_mapping"], positions=views["positions"],
            block_size=self.block_size,
            max_context_len=max(self.context_lens, default=0) if max_context_len is None else max_context_len,
            seg_bounds=list(zip(starts[:-1], starts[1:])), seg_num_blocks=self.seg_num_blocks,
            seg_context_lens=self.context_lens)
        return ModelBatch(self.operation, attn.positions, views["depths"], attn,
                          token_ids=views.get("token_ids"), seeds=views.get("seeds"),
                          logits_indices=views.get("logits_indices"))


def host_batch(operation: Operation, rows_seg: list[int], rows_pos: list[int], seg_blocks: list[list[int]],
               block_size: int, depths: list[int] | None = None, **fields) -> HostBatch:
    """Attention metadata from per-row (segment, position) and each segment's block ids.

    Rows of one segment must be consecutive in the batch. An empty block list means the
    plane does not exist for this Operation (e.g. Ouro's embedding-only PRELUDE): no slots.
    `fields`: token_ids, seeds, logits_indices.
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
    table = []
    for s, blocks in enumerate(seg_blocks):
        table += list(blocks[:nblk[s]]) + [0] * (width - nblk[s])
    slots = [seg_blocks[s][p // block_size] * block_size + p % block_size if seg_blocks[s] else -1
             for s, p in zip(rows_seg, rows_pos)]
    return HostBatch(operation, starts, list(rows_pos), slots, depths if depths is not None else [0] * len(rows_pos),
                     ctx, table, width, block_size, nblk, **fields)


def build_attn_metadata(rows_seg: list[int], rows_pos: list[int], seg_blocks: list[list[int]],
                        block_size: int, device: torch.device) -> AttnMetadata:
    """`host_batch`'s attention metadata on `device` (kernel tests and benchmarks)."""
    return host_batch(Operation.RECURRENT, rows_seg, rows_pos, seg_blocks, block_size).to(device).attn


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
