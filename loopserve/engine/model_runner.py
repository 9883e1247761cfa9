"""ModelRunner: turns a ScheduledBatch into a flat ModelBatch, runs one Operation, keeps state.

It owns the paged KV tensors and the carried loop state of rows between Operations; it
applies the exit rule after each loop and the last-exited copies of exited rows' K/V.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from loopserve.engine.cuda_graphs import DecodeGraphs
from loopserve.engine.gpu_paths import GpuPaths
from loopserve.engine.request import Request
from loopserve.engine.state_store import StateStore
from loopserve.kv_cache import BlockTable, KVLayout
from loopserve.engine.host_batch import HostBatch, host_batch
from loopserve.model.batch import LoopState, ModelBatch, device_tensor
from loopserve.model.exit_rule import exit_mask, exit_without_score
from loopserve.model.layers import fuse_elementwise
from loopserve.model.paged_kv import PagedKVCache
from loopserve.scheduler import Operation, ScheduledBatch


@dataclass(frozen=True)
class KVFence:
    """A point in the compute stream: `done()` says, without waiting, whether the device has
    run everything queued before it; `wait()` blocks until it has (None: nothing was queued,
    as on CPU)."""

    event: torch.cuda.Event | None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


class ModelRunner:
    def __init__(self, model: torch.nn.Module, layout: KVLayout, dtype: torch.dtype,
                 device: torch.device, kv_dtype: torch.dtype | None = None) -> None:
        """`kv_dtype`: the pools' storage dtype when not the model's (FP8), else None."""
        self.model = model
        self.layout = layout
        self.device = device
        self.kv = PagedKVCache(model.kv_spec, layout.block_size, layout.num_blocks,
                               layout.num_flat_blocks, dtype, device, kv_dtype)
        self.states = StateStore(model.state_dim, dtype, device)
        self._host: dict[str, tuple[torch.Tensor, torch.Tensor | None]] = {}
        self.graphs: DecodeGraphs | None = None
        self.paths: GpuPaths | None = None  # set by use_paths
        self._ops = {Operation.PRELUDE: self._prelude_op, Operation.RECURRENT: self._recurrent_op,
                     Operation.CODA: self._coda_op}

    def use_paths(self, paths: GpuPaths, model_name: str, max_batch: int, max_blocks_per_seq: int) -> None:
        """Turn on the GPU paths `paths` resolved for this device (at construction, before any
        batch: graphs are captured over the fused loop's stacked weights)."""
        self.paths = paths
        if paths.fuse_elementwise:
            fuse_elementwise()
        if not self.model.use_fused_loop(paths.fused_loop_rows) and paths.fused_loop_required:
            raise ValueError(f"fused_loop='on': model {model_name!r} has no fused loop kernel (Ouro has)")
        if paths.cuda_graphs:
            self.use_graphs(max_batch, max_blocks_per_seq, capture=True)

    def use_graphs(self, max_batch: int, max_blocks_per_seq: int, capture: bool) -> None:
        """Run decode-shaped batches through DecodeGraphs (capture=False: the padded path,
        eagerly, e.g. on CPU)."""
        self.graphs = DecodeGraphs(max_batch, max_blocks_per_seq, self.layout.block_size, self.device, capture)

    def _forward(self, hb: HostBatch) -> torch.Tensor | None:
        """The batch's Operation, its rows' loop state read from and written back to the slab
        (rows `hb.state_in` / `state_out`), replayed from a graph where one applies. Returns
        RECURRENT's exit scores or CODA's logits."""
        fn = self._ops[hb.operation]
        if self.graphs is not None and self.graphs.applies(hb):
            return self.graphs.run(hb, fn, self.states.version)
        return fn(hb.to(self.device))

    def _prelude_op(self, mb: ModelBatch) -> None:
        # (a new batch object: a graph's static one is captured twice)
        mb = dataclasses.replace(mb, token_ids=self.states.embed_ids(mb.token_ids, mb.state_in))
        state = self.model.prelude(mb, self.kv)
        self.states.put(mb.state_out, state.hidden, state.aux)

    def _recurrent_op(self, mb: ModelBatch) -> torch.Tensor:
        state, score = self.model.recurrent(mb, LoopState(*self.states.get(mb.state_in)), self.kv)
        self.states.put(mb.state_out, state.hidden, state.aux)
        return score

    def _coda_op(self, mb: ModelBatch) -> torch.Tensor:
        return self.model.coda(mb, LoopState(*self.states.get(mb.state_in)), self.kv)

    # ------------------------------------------------------------------ KV housekeeping
    def apply_kv_moves(self, swap_out: tuple, new_blocks: tuple[list[int], list[int]],
                       swap_in: tuple) -> None:
        """Offload victims, zero fresh blocks (no stale data is ever readable), restore resumed."""
        for rid, table in swap_out:
            self._host[rid] = self._gather(table)
        looped, flat = new_blocks
        if looped:
            self.kv.zero_blocks("looped", looped)
        if flat:
            self.kv.zero_blocks("flat", flat)
        for rid, table in swap_in:
            looped_data, flat_data = self._host.pop(rid)
            self.kv.scatter_blocks("looped", [b for p in table.depth for b in p], looped_data)
            if flat_data is not None:
                self.kv.scatter_blocks("flat", table.flat, flat_data)

    def _gather(self, table: BlockTable) -> tuple[torch.Tensor, torch.Tensor | None]:
        looped = self.kv.gather_blocks("looped", [b for p in table.depth for b in p])
        flat = self.kv.gather_blocks("flat", table.flat) if table.flat else None
        return looped, flat

    def fence(self) -> KVFence:
        """A mark after every kernel queued so far on the compute stream (the stream the KV
        zeroing and the decode kernels run on). A write that bypasses that stream (a NIXL READ
        into a handed-off request's blocks) must start only after the mark has run: the stream
        may still hold the zeroing of those blocks, or the last K/V writes of the request that
        held them before, and either would land on the KV read in (with defer_readback and
        CUDA graphs the host runs a whole token's Operations ahead of the GPU). Unlike a device
        sync it does not wait for other streams (READs already in flight, copies)."""
        if self.device.type != "cuda":
            return KVFence(None)  # each CPU kernel has run when its call returns
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return KVFence(event)

    def drop(self, request_id: str) -> None:
        self.states.drop(request_id)
        self._host.pop(request_id, None)

    def keep_tokens(self, request_ids: list[str], positions: list[int], ids: torch.Tensor) -> None:
        """Sampled ids (on the device) that the requests' PRELUDEs at `positions` embed: the
        host need not have read them by then. They wait in those positions' slab rows."""
        rows = self.states.rows([(rid, [p]) for rid, p in zip(request_ids, positions)], assign=True)
        self.states.put_tokens(device_tensor(rows, torch.int64, self.device), ids)

    # ------------------------------------------------------------------ batch building
    def _batch(self, batch: ScheduledBatch, reqs: dict[str, Request], tables: dict[str, BlockTable],
               with_tokens: bool = False) -> HostBatch:
        """The batch on the host, with its rows' state slab rows (fresh ones for a PRELUDE)."""
        op, items = batch.operation, batch.items
        if op is Operation.RECURRENT:
            plane = self.model.plane_of_depth
            seg_blocks = [tables[i.request_id].depth[plane(i.depth) - 1] for i in items]
        else:
            seg_blocks = [tables[i.request_id].flat for i in items]
        token_ids = seeds = logits_indices = None
        if with_tokens:
            token_ids, seeds = [], []
            held = self.states.holds
            for i in items:
                req, ps = reqs[i.request_id], i.positions
                if len(ps) == 1 and held(i.request_id, ps[0]):
                    token_ids.append(-1)  # a sampled id kept in its slab row (keep_tokens)
                else:
                    token_ids += req.tokens_at(ps)
                seeds += [req.seed] * len(ps)
        if op is Operation.CODA:
            logits_indices, row = [], 0
            for item in batch.items:
                want = set(item.logits_positions)
                logits_indices += [row + j for j, p in enumerate(item.positions) if p in want]
                row += len(item.positions)
        rows = self.states.rows([(i.request_id, list(i.positions)) for i in items], assign=op is Operation.PRELUDE)
        return host_batch(op, [i.positions for i in items], seg_blocks, self.layout.block_size,
                          [i.depth for i in items], token_ids=token_ids, seeds=seeds, logits_indices=logits_indices,
                          state_in=rows, state_out=rows)

    # ------------------------------------------------------------------ operations
    @torch.inference_mode()
    def prelude(self, batch: ScheduledBatch, reqs: dict[str, Request], tables: dict[str, BlockTable]) -> None:
        self._forward(self._batch(batch, reqs, tables, with_tokens=True))

    @torch.inference_mode()
    def recurrent(self, batch: ScheduledBatch, reqs: dict[str, Request], tables: dict[str, BlockTable],
                  draft_loops: int) -> dict[str, tuple[int, ...]]:
        """One loop for every row; returns, per request, the positions that made their final exit."""
        hb = self._batch(batch, reqs, tables)
        score = self._forward(hb)
        exits = self._exits(batch, reqs, hb, score)
        exited: dict[str, tuple[int, ...]] = {}
        src, dst, row = [], [], 0
        bs = self.layout.block_size
        for item in batch.items:
            req, table = reqs[item.request_id], tables[item.request_id]
            mine = [p for j, p in enumerate(item.positions) if exits[row + j]]
            row += len(item.positions)
            exited[item.request_id] = tuple(mine)
            for p in mine:
                req.exit_depth[p] = item.depth
                k = self.model.plane_of_depth(item.depth)
                here = table.depth[k - 1][p // bs] * bs + p % bs
                for plane in table.depth[k:]:  # last-exited rule: fill every deeper plane
                    src.append(here)
                    dst.append(plane[p // bs] * bs + p % bs)
        if src:
            dev = self.device
            self.kv.copy_slots_looped(device_tensor(src, torch.int64, dev), device_tensor(dst, torch.int64, dev))
        return exited

    def _exits(self, batch: ScheduledBatch, reqs: dict[str, Request], hb: HostBatch,
               score: torch.Tensor) -> list[bool]:
        """Per row: exits after this loop. Read from the device only when a score can change
        a decision (adaptive exit in [min, max) loops): otherwise the host knows, and the next
        batch is prepared while this one is still running."""
        params = [reqs[i.request_id].params for i in batch.items]
        counts = [len(i.positions) for i in batch.items]
        known = [exit_without_score(i.depth, p.min_loops, p.max_loops, p.exit_threshold)
                 for i, p in zip(batch.items, params)]
        if None not in known:
            return [k for k, n in zip(known, counts) for _ in range(n)]

        def per_row(field: str) -> list:
            return [getattr(p, field) for p, n in zip(params, counts) for _ in range(n)]

        ints = device_tensor(hb.depths + per_row("min_loops") + per_row("max_loops"), torch.int64,
                             self.device).view(3, -1)  # one copy for the three integer rows
        return exit_mask(ints[0], score, ints[1], ints[2],
                         device_tensor(per_row("exit_threshold"), torch.float32, self.device)).tolist()

    @torch.inference_mode()
    def coda(self, batch: ScheduledBatch, reqs: dict[str, Request],
             tables: dict[str, BlockTable]) -> dict[str, torch.Tensor | None]:
        """Coda for every row (writes coda KV); logits of each item's logits_positions."""
        logits = self._forward(self._batch(batch, reqs, tables))
        out: dict[str, torch.Tensor | None] = {}
        row = 0
        for item in batch.items:
            n = len(item.logits_positions)
            out[item.request_id] = logits[row:row + n] if n else None
            row += n
            if not item.draft:  # a draft round keeps its shallow rows for the verify loops
                self.states.drop(item.request_id)
        return out
