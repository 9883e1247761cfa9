"""Host-side batch packing: an Operation's rows as host lists, copied to the device once."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from loopserve.intmath import cdiv
from loopserve.model.batch import AttnMetadata, ModelBatch, to_device
from loopserve.scheduler.types import Operation


_OPTIONAL64 = ("token_ids", "seeds", "logits_indices", "state_in", "state_out")  # HostBatch's optional fields


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
    state_in: list[int] | None = None
    state_out: list[int] | None = None

    @property
    def num_rows(self) -> int:
        return len(self.positions)

    @property
    def num_segs(self) -> int:
        return len(self.context_lens)

    def padded(self, rows: int, width: int, state_in_pad: int, state_out_pad: int) -> HostBatch:
        """A decode-shaped batch (one row per segment) padded to `rows` rows and a table
        `width`, every optional field present: the CUDA-graph buffers' fixed layout. Padding
        rows are harmless: position 0, slot -1 (no K/V write), a table of block 0 (read only),
        the first row's depth, state read from `state_in_pad` and written to `state_out_pad`
        (rows no request owns), and their outputs are dropped."""
        t, pad = self.num_rows, rows - self.num_rows
        table = []
        for s in range(t):
            table += self.block_tables[s * self.width:(s + 1) * self.width] + [0] * (width - self.width)
        return HostBatch(
            self.operation, list(range(rows + 1)), self.positions + [0] * pad, self.slot_mapping + [-1] * pad,
            self.depths + self.depths[:1] * pad, self.context_lens + [1] * pad, table + [0] * (pad * width),
            width, self.block_size, self.seg_num_blocks + [1] * pad,
            (self.token_ids or [0] * t) + [0] * pad, (self.seeds or [0] * t) + [0] * pad, list(range(rows)),
            (self.state_in or [state_in_pad] * t) + [state_in_pad] * pad,
            (self.state_out or [state_out_pad] * t) + [state_out_pad] * pad)

    @property
    def nbytes(self) -> int:
        """Size of `pack()`'s bytes."""
        n64 = len(self.seg_starts) + 3 * self.num_rows + sum(
            len(getattr(self, n)) for n in _OPTIONAL64 if getattr(self, n) is not None)
        return 8 * n64 + 4 * (self.num_segs + len(self.block_tables))

    def pack(self) -> tuple[torch.Tensor, list[tuple[str, int, torch.dtype]]]:
        """(bytes on the host, [(field, length, dtype)]): int64 fields first, then int32, so
        every field's view of the bytes is aligned."""
        names64 = ["seg_starts", "positions", "slot_mapping", "depths"] + [
            n for n in _OPTIONAL64 if getattr(self, n) is not None]
        v64 = array("q")
        for n in names64:
            v64.extend(getattr(self, n))
        v32 = array("i", self.context_lens)
        v32.extend(self.block_tables)
        raw = bytearray(v64)
        raw += v32
        host = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        fields = [(n, len(getattr(self, n)), torch.int64) for n in names64]
        fields += [("context_lens", self.num_segs, torch.int32), ("block_tables", len(self.block_tables), torch.int32)]
        return host, fields

    def copy_to(self, out: torch.Tensor) -> list[tuple[str, int, torch.dtype]]:
        """pack()'s bytes into `out` (exactly nbytes; from pinned memory, asynchronously, on
        CUDA): all a replayed graph needs, no views built. Returns pack()'s fields."""
        host, fields = self.pack()
        out.copy_(host.pin_memory() if out.device.type == "cuda" else host, non_blocking=True)
        return fields

    def to(self, device: torch.device, out: torch.Tensor | None = None,
           max_context_len: int | None = None) -> ModelBatch:
        """The ModelBatch on `device` from one copy (into `out` if given: a buffer of exactly
        the packed size). `max_context_len` overrides the launch bound (graph buckets)."""
        if out is None:
            host, fields = self.pack()
            dev = to_device(host, device)
        else:
            fields, dev = self.copy_to(out), out
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
        return ModelBatch(attn.positions, views["depths"], attn,
                          **{n: views.get(n) for n in _OPTIONAL64})


def _slots(positions: Sequence[int], blocks: list[int], block_size: int) -> list[int]:
    """Each position's cache slot; a contiguous run (a prefill chunk) block by block."""
    n = len(positions)
    if n > block_size and list(positions) == list(range(positions[0], positions[0] + n)):
        out: list[int] = []
        lo, hi = positions[0], positions[0] + n
        for i in range(lo // block_size, cdiv(hi, block_size)):
            shift = (blocks[i] - i) * block_size
            out += range(max(lo, i * block_size) + shift, min(hi, (i + 1) * block_size) + shift)
        return out
    return [blocks[p // block_size] * block_size + p % block_size for p in positions]


def host_batch(operation: Operation, seg_positions: list[Sequence[int]], seg_blocks: list[list[int]],
               block_size: int, seg_depths: list[int] | None = None, **fields) -> HostBatch:
    """A batch from each segment's positions (one request's rows on one plane), block ids
    and loop depth; the segments' rows follow each other in the batch.

    An empty block list means the plane does not exist for this Operation (e.g. Ouro's
    embedding-only PRELUDE): no slots. `fields`: token_ids, seeds, logits_indices, state_in,
    state_out.
    """
    starts, ctx, nblk, positions, slots, depths = [0], [], [], [], [], []
    for s, (ps, blocks) in enumerate(zip(seg_positions, seg_blocks)):
        starts.append(starts[-1] + len(ps))
        c = max(ps) + 1 if ps else 0
        need = cdiv(c, block_size) if blocks else 0
        if blocks and need > len(blocks):
            raise ValueError(f"segment {s}: context {c} needs {need} blocks, table has {len(blocks)}")
        ctx.append(c)
        nblk.append(need)
        positions += ps
        slots += _slots(ps, blocks, block_size) if blocks else [-1] * len(ps)
        depths += [seg_depths[s] if seg_depths is not None else 0] * len(ps)
    width = max(nblk, default=0) or 1
    table: list[int] = []
    for blocks, n in zip(seg_blocks, nblk):
        table += blocks[:n]
        table += [0] * (width - n)
    return HostBatch(operation, starts, positions, slots, depths, ctx, table, width, block_size, nblk, **fields)
