"""CUDA graphs for decode-shaped batches (one row per request, the steady state of serving).

Eager PyTorch spends ~30 us of host time per kernel launch and one loop of a 24-layer model
launches over a thousand, so decode is launch-bound. Here each (Operation, padded batch
size, context bucket) gets one graph, captured on first use; a step copies the padded host
batch into the size's static buffer in one transfer and replays (`HostBatch.padded` says
why padding rows are harmless).

The context bucket (max context rounded up to a power of two) fixes the attention's split
count at capture; splits beyond what a shorter context needs are empty and merge to
nothing. `capture=False` runs the same padded static-buffer path eagerly: the CPU twin CI
tests, since capture needs CUDA (and the Triton backend: no host loops over segments).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from loopserve.model.batch import HostBatch, LoopState, ModelBatch
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
        self.width = max_blocks_per_seq
        self.capture = capture
        self.device = device
        n = self.sizes[-1]
        self.hidden = torch.zeros(n, state_dim, dtype=dtype, device=device)
        self.aux = torch.ones(n, dtype=torch.float32, device=device)
        self._inputs: dict[int, torch.Tensor] = {}  # padded size -> its packed static batch
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._pool = torch.cuda.graph_pool_handle() if capture else None
        self.runs = 0  # batches served through the padded path (replays when capturing)

    def applies(self, hb: HostBatch) -> bool:
        """Decode-shaped: one row per segment, every row's logits (CODA), within the sizes."""
        t = hb.num_rows
        return (0 < t <= self.sizes[-1] and hb.num_segs == t
                and (hb.logits_indices is None or len(hb.logits_indices) == t)
                and hb.width <= self.width)

    def run(self, hb: HostBatch, state: LoopState | None, forward: Forward):
        """forward(batch, state) for a decode-shaped batch: its padded fields go to the static
        buffers in one host-to-device copy, then the graph replays."""
        t = hb.num_rows
        p = _bucket(t, self.sizes)
        ctx = max(MIN_CONTEXT_BUCKET, 1 << max(max(hb.context_lens) - 1, 0).bit_length())
        padded = hb.padded(p, self.width)
        if p not in self._inputs:
            self._inputs[p] = torch.empty(padded.nbytes, dtype=torch.uint8, device=self.device)
        smb = _decode_view(padded.to(self.device, out=self._inputs[p], max_context_len=ctx))
        sstate = None
        if state is not None:
            self.hidden[:t].copy_(state.hidden)
            self.aux[:t].copy_(state.aux)
            sstate = LoopState(self.hidden[:p], self.aux[:p])
        if not self.capture:
            out = forward(smb, sstate)
        else:
            key = (hb.operation, p, ctx)
            if key not in self._graphs:
                self._graphs[key] = self._record(forward, smb, sstate)
            graph, out = self._graphs[key]
            graph.replay()
        self.runs += 1
        return _rows(out, t)

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


def _decode_view(mb: ModelBatch) -> ModelBatch:
    """The Operation's own fields of a padded batch (whose layout carries all of them)."""
    op = mb.operation
    if op is not Operation.PRELUDE:
        mb.token_ids = mb.seeds = None
    if op is not Operation.CODA:
        mb.logits_indices = None
    return mb


def _rows(out, t: int):
    """The first t rows of every output tensor, copied out of the graph's memory."""
    if isinstance(out, torch.Tensor):
        return out[:t].clone()
    if isinstance(out, LoopState):
        return LoopState(out.hidden[:t].clone(), out.aux[:t].clone())
    return tuple(_rows(o, t) for o in out)

