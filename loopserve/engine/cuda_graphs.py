"""CUDA graphs for decode-shaped batches (one row per request, the steady state of serving).

Eager PyTorch spends ~30 us of host time per kernel launch and one loop of a 24-layer model
launches over a thousand, so decode is launch-bound. Here each (Operation, padded batch
size, context bucket) gets one graph, captured on first use; a step copies the batch into
static buffers and replays. Padded rows are harmless: position 0, block table of zeros
(read only), slot -1 (the KV writes skip it), and their outputs are dropped.

The context bucket (max context rounded up to a power of two) fixes the attention's split
count at capture; splits beyond what a shorter context needs are empty and merge to
nothing. `capture=False` runs the same padded static-buffer path eagerly: the CPU twin CI
tests, since capture needs CUDA (and the Triton backend: no host loops over segments).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loopserve.model.batch import AttnMetadata, LoopState, ModelBatch
from loopserve.scheduler import Operation

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MIN_CONTEXT_BUCKET = 128

Forward = Callable[[ModelBatch, LoopState | None], object]


def _bucket(n: int, sizes: tuple[int, ...]) -> int:
    return next(s for s in sizes if s >= n)


class DecodeGraphs:
    def __init__(self, max_batch: int, max_blocks_per_seq: int, block_size: int, state_dim: int,
                 dtype: torch.dtype, device: torch.device, capture: bool) -> None:
        self.sizes = tuple(s for s in SIZES if s < max_batch) + (min(max_batch, SIZES[-1]),)
        self.block_size = block_size
        self.capture = capture
        n, dev = self.sizes[-1], device
        long = dict(dtype=torch.long, device=dev)
        self.token_ids = torch.zeros(n, **long)
        self.seeds = torch.zeros(n, **long)
        self.positions = torch.zeros(n, **long)
        self.depths = torch.zeros(n, **long)
        self.slots = torch.full((n,), -1, **long)
        self.seg_starts = torch.arange(n + 1, **long)
        self.tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.context = torch.ones(n, dtype=torch.int32, device=dev)
        self.rows = torch.arange(n, **long)
        self.hidden = torch.zeros(n, state_dim, dtype=dtype, device=dev)
        self.aux = torch.ones(n, dtype=torch.float32, device=dev)
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.runs = 0  # batches served through the padded path (replays when capturing)

    def applies(self, mb: ModelBatch) -> bool:
        """Decode-shaped: one row per segment, every row's logits (CODA), within the sizes."""
        t = mb.num_rows
        return (0 < t <= self.sizes[-1] and len(mb.attn.seg_bounds) == t
                and (mb.logits_indices is None or mb.logits_indices.shape[0] == t)
                and mb.attn.block_tables.shape[1] <= self.tables.shape[1])

    def run(self, mb: ModelBatch, state: LoopState | None, forward: Forward):
        """forward(mb, state) for a decode-shaped batch, through the padded static buffers."""
        t = mb.num_rows
        p = _bucket(t, self.sizes)
        ctx = max(MIN_CONTEXT_BUCKET, 1 << max(mb.attn.max_context_len - 1, 0).bit_length())
        self._load(mb, state, t, p)
        smb, sstate = self._static(mb, p, ctx, state is not None)
        if not self.capture:
            out = forward(smb, sstate)
        else:
            key = (mb.operation, p, ctx)
            if key not in self._graphs:
                self._graphs[key] = self._record(forward, smb, sstate)
            graph, out = self._graphs[key]
            graph.replay()
        self.runs += 1
        return _rows(out, t)

    def _load(self, mb: ModelBatch, state: LoopState | None, t: int, p: int) -> None:
        a = mb.attn
        self.positions[:t].copy_(mb.positions)
        self.positions[t:p].zero_()
        self.slots[:t].copy_(a.slot_mapping)
        self.slots[t:p].fill_(-1)
        w = a.block_tables.shape[1]
        self.tables[:t, :w].copy_(a.block_tables)
        self.tables[t:p].zero_()
        self.context[:t].copy_(a.context_lens)
        self.context[t:p].fill_(1)
        if mb.token_ids is not None:
            self.token_ids[:t].copy_(mb.token_ids)
            self.seeds[:t].copy_(mb.seeds)
        if mb.operation is Operation.RECURRENT:
            self.depths[:t].copy_(mb.depths)
            self.depths[t:p].copy_(mb.depths[:1].expand(p - t))
        if state is not None:
            self.hidden[:t].copy_(state.hidden)
            self.aux[:t].copy_(state.aux)

    def _static(self, mb: ModelBatch, p: int, ctx: int, with_state: bool) -> tuple[ModelBatch, LoopState | None]:
        op, t = mb.operation, mb.num_rows
        attn = AttnMetadata(
            seg_starts=self.seg_starts[:p + 1], block_tables=self.tables[:p],
            context_lens=self.context[:p], slot_mapping=self.slots[:p], positions=self.positions[:p],
            block_size=self.block_size, max_context_len=ctx,
            seg_bounds=[(i, i + 1) for i in range(p)],
            seg_num_blocks=[*mb.attn.seg_num_blocks, *[1] * (p - t)],  # host loops only: CPU twin
            seg_context_lens=[*mb.attn.seg_context_lens, *[0] * (p - t)])
        mb = ModelBatch(op, self.positions[:p], self.depths[:p], attn,
                        token_ids=self.token_ids[:p] if op is Operation.PRELUDE else None,
                        seeds=self.seeds[:p] if op is Operation.PRELUDE else None,
                        logits_indices=self.rows[:p] if op is Operation.CODA else None)
        state = LoopState(self.hidden[:p], self.aux[:p]) if with_state else None
        return mb, state

    def _record(self, forward: Forward, mb: ModelBatch, state: LoopState | None):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles kernels; writes the same K/V as replay
            forward(mb, state)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            out = forward(mb, state)
        return graph, out


def _rows(out, t: int):
    """The first t rows of every output tensor, copied out of the graph's memory."""
    if isinstance(out, torch.Tensor):
        return out[:t].clone()
    if isinstance(out, LoopState):
        return LoopState(out.hidden[:t].clone(), out.aux[:t].clone())
    return tuple(_rows(o, t) for o in out)

