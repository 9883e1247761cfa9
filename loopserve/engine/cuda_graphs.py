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

The Operation passed in gathers its rows' loop state from the engine's slab and scatters the
new state back itself (the slab rows travel in the batch), so a replay is the batch's one
copy, one launch and the copy of its output: with the gather, scatter and copies in and out of
static state buffers around the replay, a batch-1 RECURRENT step spent 404 µs of host time
before its replay on the H200 (95 µs now; `benchmarks/experiments/decode_bubble_gpu.py`), and the host
time between a token's sample and its first loop is GPU idle time.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from loopserve.engine.state_store import SINK, ZERO
from loopserve.engine.host_batch import HostBatch
from loopserve.model.batch import ModelBatch
from loopserve.scheduler import Operation

SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
MIN_CONTEXT_BUCKET = 128

Forward = Callable[[ModelBatch], object]  # the Operation, its state gathered and scattered by slab rows


def _bucket(n: int, sizes: tuple[int, ...]) -> int:
    return next(s for s in sizes if s >= n)


class DecodeGraphs:
    def __init__(self, max_batch: int, max_blocks_per_seq: int, block_size: int,
                 device: torch.device, capture: bool) -> None:
        self.sizes = tuple(s for s in SIZES if s < max_batch) + (min(max_batch, SIZES[-1]),)
        self.block_size = block_size
        self.width = max_blocks_per_seq
        self.capture = capture
        self.device = device
        self._inputs: dict[int, torch.Tensor] = {}  # padded size -> its packed static batch
        self._graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self._slab_version: int | None = None  # the state slab the graphs were captured on
        self._pool = None  # the graphs' memory pool, one per slab version (run)
        self.runs = 0  # batches served through the padded path (replays when capturing)
        self.captures = 0  # graphs recorded (a first use also runs the batch to warm up and
        # compiles the kernel specialisations its shapes need: mid-serving, a stall)

    def applies(self, hb: HostBatch) -> bool:
        """Decode-shaped: one row per segment, every row's logits (CODA), within the sizes."""
        t = hb.num_rows
        return (0 < t <= self.sizes[-1] and hb.num_segs == t
                and (hb.logits_indices is None or len(hb.logits_indices) == t)
                and hb.width <= self.width)

    def run(self, hb: HostBatch, forward: Forward, slab_version: int):
        """forward(batch) for a decode-shaped batch: its padded fields go to the static buffer
        in one host-to-device copy, then the graph replays (captured on first use, and again
        once the state slab has moved: `slab_version`)."""
        t = hb.num_rows
        p = _bucket(t, self.sizes)
        ctx = max(MIN_CONTEXT_BUCKET, 1 << max(max(hb.context_lens) - 1, 0).bit_length())
        padded = hb.padded(p, self.width, ZERO, SINK)
        if p not in self._inputs:
            self._inputs[p] = torch.empty(padded.nbytes, dtype=torch.uint8, device=self.device)
        buf = self._inputs[p]
        self.runs += 1
        if not self.capture:
            return _rows(forward(_decode_view(padded.to(self.device, out=buf, max_context_len=ctx), hb.operation)), t)
        if slab_version != self._slab_version:
            self._graphs.clear()
            self._slab_version = slab_version
            # A fresh pool: the allocator keeps a pool whose graphs are all gone (use count 0)
            # until it empties its cache, and capturing into it again fails an internal assert.
            self._pool = torch.cuda.graph_pool_handle()
        key = (hb.operation, p, ctx)
        if key not in self._graphs:
            # the warm-up runs for real: its state goes to SINK, so the replay below starts
            # from the same state (its K/V writes are the replay's)
            sunk = dataclasses.replace(padded, state_out=[SINK] * p)
            self.captures += 1
            self._graphs[key] = self._record(forward, _decode_view(sunk.to(self.device, out=buf, max_context_len=ctx), hb.operation))
        padded.copy_to(buf)
        graph, out = self._graphs[key]
        graph.replay()
        return _rows(out, t)

    def _record(self, forward: Forward, mb: ModelBatch):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up: compiles kernels
            forward(mb)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: a capture (lazy, mid-serving) must not fail the CUDA calls other threads
        # make meanwhile, such as UCX's stream syncs for a NIXL READ in flight (global mode did:
        # 'operation not permitted when stream is capturing', and the worker died)
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            out = forward(mb)
        return graph, out


def _decode_view(mb: ModelBatch, op: Operation) -> ModelBatch:
    """Operation `op`'s own fields of a padded batch (whose layout carries all of them)."""
    if op is not Operation.PRELUDE:
        mb.token_ids = mb.seeds = None
    if op is not Operation.CODA:
        mb.logits_indices = None
    return mb


def _rows(out: torch.Tensor | None, t: int) -> torch.Tensor | None:
    """The first t rows of the output (scores, logits), copied out of the graph's memory."""
    return None if out is None else out[:t].clone()

