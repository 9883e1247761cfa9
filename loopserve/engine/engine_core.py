"""EngineCore: one step = schedule one single-Operation batch, run it, feed results back.

It wires the parts and keeps stepping and the PD role API; a request's validation is
`Intake`'s, what a CODA's logits become is `CodaAcceptance`'s, and which GPU paths run is
`GpuPaths`' (applied by the model runner). Plain Python objects (no Ray): a Ray actor, a
plain process or the LLM class can host it.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import torch

from loopserve.engine import handoff
from loopserve.engine.acceptance import CodaAcceptance
from loopserve.engine.config import EngineConfig
from loopserve.engine.gpu_paths import GpuPaths
from loopserve.engine.intake import Intake
from loopserve.engine.model_runner import KVFence, ModelRunner
from loopserve.engine.readback import UnreadBatch, UnreadSamples
from loopserve.engine.request import Request
from loopserve.intmath import cdiv
from loopserve.protocol.handoff import HandoffMessage
from loopserve.protocol.model_limits import ModelLimits
from loopserve.protocol.outputs import RequestOutput
from loopserve.protocol.prefix_keys import PrefixKeyer
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.protocol.stats import EngineCounters, EngineStats, PoolUsage, PrefixCacheStats
from loopserve.kv_cache import BlockTable, KVCacheManager, KVLayout
from loopserve.model.paged_kv import KV_CACHE_DTYPES
from loopserve.model.registry import resolve_model
from loopserve.model.tokenizer import load_tokenizer, tokenizer_file
from loopserve.scheduler import BatchResult, ItemResult, Operation, Scheduler, ScheduledBatch

log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class EngineFailedError(RuntimeError):
    """New work for an engine whose step raised: it runs nothing more."""


class EngineCore:
    def __init__(self, config: EngineConfig, model: torch.nn.Module | None = None) -> None:
        self.config = config
        dtype = _DTYPES[config.dtype]
        self.device = torch.device(config.device)
        self.model = model if model is not None else resolve_model(
            config.model, dtype=dtype, device=self.device, seed=config.seed
        )
        tokenizer = tokenizer_file(config.tokenizer, config.model)
        self.tokenizer = load_tokenizer(tokenizer, vocab_size=self.model.vocab_size)
        sc = config.scheduler
        if getattr(self.model, "last_loop_kv", False) and (sc.split_prefill or sc.speculative):
            # Within one piece, loop d of a token reads the earlier tokens' loop-d K/V; the
            # reference semantics (transformers) give them the last loop's K/V instead.
            raise ValueError("split_prefill and speculative decoding are not supported for a model "
                             "whose loops share one KV plane (recurrent_kv_cache_mode='last_loop'): "
                             "prompts must run whole and later tokens one at a time")
        spec = self.model.kv_spec
        self.max_loops = self.model.max_loops
        has_flat = spec.num_flat_layers > 0
        num_flat = (config.num_flat_blocks or config.num_blocks // self.max_loops + 1) if has_flat else 0
        self.layout = KVLayout(config.block_size, config.num_blocks, num_flat, has_flat)
        self.kv_manager = KVCacheManager(self.layout, incremental=sc.incremental_kv)
        seeded = self.model.prefix_cache_seeded() if config.enable_prefix_caching else None
        d = self.model.default_loop_params
        self.limits = ModelLimits(config.model, tokenizer, config.max_model_len, self.model.vocab_size,
                                  (d.min_loops, d.max_loops, d.exit_threshold), self.max_loops)
        self.prefix_keyer: PrefixKeyer | None = None if seeded is None else PrefixKeyer(
            config.model, config.dtype, config.kv_cache_dtype, config.block_size,
            tuple(self.model.kv_planes(m) for m in range(1, self.max_loops + 1)), seeded)
        self.scheduler = Scheduler(sc.model_copy(update={"coda_writes_kv": self.model.coda_writes_kv}),
                                   self.kv_manager)
        self.runner = ModelRunner(self.model, self.layout, dtype, self.device,
                                  KV_CACHE_DTYPES[config.kv_cache_dtype])
        paths = GpuPaths.resolve(config, self.device)
        self.runner.use_paths(paths, config.model, sc.max_num_seqs, cdiv(config.max_model_len, config.block_size))
        self.intake = Intake(config, self.limits, self.model, self.tokenizer, self.prefix_keyer)
        self.requests: dict[str, Request] = {}
        self.counters = EngineCounters()
        self.acceptance = CodaAcceptance(self.runner, self.counters, paths.defer_readback)
        self._pending_outputs: list[RequestOutput] = []
        self._executor = ThreadPoolExecutor(1, "loopserve-exec") if config.async_scheduling else None
        self._inflight: tuple[ScheduledBatch, Future] | None = None
        self._handoffs: list[HandoffMessage] = []
        self._unread = UnreadSamples()
        self.error: str | None = None  # why the engine failed (see fail); None while it serves

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validate and queue a request; ValueError names the bad field and its limit."""
        self._check_alive()
        req, sched = self.intake.request(prompt, params, request_id, arrival_time, self.requests)
        # KVCapacityError if it can never fit, QueueFullError beyond max_waiting
        self.scheduler.add_request(sched)
        self.requests[req.request_id] = req
        self.counters.prompt_tokens += req.prompt_len
        return req.request_id

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"unknown request_id {request_id!r}")
        self.scheduler.abort(request_id)
        if not req.finished:
            req.finish_reason = "abort"
            self.counters.requests_aborted += 1
        if not req.final_sent:
            self._pending_outputs.append(req.take_output())
        self._retire(request_id)

    def _retire(self, request_id: str) -> None:
        """Forget a finished request once no batch in flight still holds it."""
        st = self.scheduler.get_request(request_id)
        if st is not None and st.in_flight:
            return
        self._unread.drop(request_id)  # a sample of an aborted request is never read
        self.requests.pop(request_id, None)
        self.runner.drop(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests or self._pending_outputs) or self._inflight is not None

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run (or launch) one batch; the outputs of every request with news. If anything in
        the step raises, the engine fails (see fail) and this returns every request's end."""
        try:
            return self._step()
        except Exception as e:  # noqa: BLE001 - whatever broke, the engine's requests must end
            log.exception("engine step failed; failing every request")
            return self.fail(e)

    def fail(self, error: BaseException) -> list[RequestOutput]:
        """Stop serving for good: a step raised, so the device state may be corrupt (a CUDA
        fault poisons the context) and no batch may run again. Every request ends now with
        finish_reason "error" and the exception's message, not after a timeout; the batch
        still running (async scheduling) is waited for, then every block, slot and state
        row is freed; new requests are refused. Returns the outputs still owed."""
        if self.error is None:
            self.error = f"engine failed: {type(error).__name__}: {error}"
        if self._executor is not None:
            self._executor.shutdown(wait=True)  # nothing may still write to what is freed below
        self._inflight, self._handoffs = None, []
        self._unread.clear()
        self.scheduler.abort_all()
        outputs, self._pending_outputs = self._pending_outputs, []
        for rid, req in self.requests.items():
            if not req.final_sent:
                req.finish_reason = "error"
                outputs.append(req.take_output(error=self.error))
            self.runner.drop(rid)
        self.requests.clear()
        return outputs

    def _check_alive(self) -> None:
        if self.error is not None:
            raise EngineFailedError(f"the engine takes no new requests: {self.error}")

    def _step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        self.runner.apply_kv_moves(out.swap_out, self.kv_manager.pop_new_blocks(), out.swap_in)
        self.counters.preemptions += len(out.preempted)
        batch = out.batch
        if batch is not None and self._unread and batch.operation is Operation.CODA:
            # A request's samples reach the host in order and its next draw is numbered after
            # them: read its last one first (long done: its PRELUDE and loops ran since).
            self._read_back({i.request_id for i in batch.items}, wait=True)
        if self._executor is None:
            if batch is not None:
                result = self._execute(batch)
                self._read_back()  # while the device runs this batch
                self._finish(batch, *result)
        else:
            fut = self._executor.submit(self._execute, batch) if batch is not None else None
            if self._inflight is not None:
                prev, prev_fut = self._inflight
                self._inflight = None
                self._finish(prev, *prev_fut.result())
            self._inflight = (batch, fut) if fut is not None else None
            self._read_back()
        if batch is None and self._unread:
            self._read_back(wait=True)  # nothing was launched to overlap the wait with
        outputs, self._pending_outputs = self._pending_outputs, []
        return outputs

    def _read_back(self, only: set[str] | None = None, wait: bool = False) -> None:
        """Apply deferred samples on the host: those already drawn, or (wait) those of `only`.

        A token that stops its request was seen after the request's next work was scheduled:
        the request ends here, its work in flight is dropped when the batch retires.
        """
        if not self._unread:
            return
        got: list[Request] = []
        for rid, sample, pos in self._unread.take(only, wait):
            req = self.requests.get(rid)
            if req is None or req.final_sent:  # aborted meanwhile
                continue
            req.append(sample, pos)
            self.counters.tokens_generated += 1
            got.append(req)
        for req in got:
            if not req.finished:
                self._pending_outputs.append(req.take_output())
            elif self.scheduler.stop(req.request_id):
                self.counters.requests_finished += 1
                self._pending_outputs.append(req.take_output())
                self._retire(req.request_id)
            # else the scheduler ended it in the batch being retired, which reports it

    def _finish(self, batch: ScheduledBatch, result: BatchResult, unread: UnreadBatch | None = None) -> None:
        if unread is not None:
            self._unread.add(unread)
        events = self.scheduler.update(batch, result)
        if self._unread and events.finished:
            self._read_back(set(events.finished), wait=True)  # their last tokens, before the final output
        touched = {i.request_id for i in batch.items}
        for rid in touched:
            req = self.requests.get(rid)
            if req is None:
                continue
            if req.final_sent:  # ended outside this batch: aborted, or a stop read back late
                self._retire(rid)
                continue
            if req.has_news() or req.finished:
                self._pending_outputs.append(req.take_output())
        for rid in events.finished:
            req = self.requests.get(rid)
            if req is not None and req.finish_reason != "abort":
                self.counters.requests_finished += 1
            self._retire(rid)
        self.on_transferring(events.transferring)

    # ------------------------------------------------------------------ PD roles
    def on_transferring(self, request_ids: list[str]) -> None:
        """Prefill role: the prompt is done and its KV awaits a reader; describe the handoff."""
        for rid in request_ids:
            self._handoffs.append(handoff.pack(self.requests[rid], self.kv_manager.block_table(rid),
                                               self.kv_compat()))

    def take_handoffs(self) -> list[HandoffMessage]:
        out, self._handoffs = self._handoffs, []
        return out

    def transfer_done(self, request_id: str) -> None:
        """Prefill role: the decode side has read the KV (or gave up); free the blocks."""
        self.scheduler.transfer_done(request_id)
        self._retire(request_id)

    def place_handoff(self, h: HandoffMessage) -> tuple[BlockTable, KVFence] | None:
        """Decode role: take over a prefilled request; returns the blocks to read KV into and
        the fence a READ into them must wait for, without waiting (the worker's step thread
        keeps stepping and posts the READ once `fence.done()`).

        None when blocks are short right now (the caller retries or routes elsewhere).
        """
        self._check_alive()
        req, sched = self.intake.handoff(h, self.requests)
        if not self.scheduler.add_receiving(sched, h.num_kv_tokens):
            return None
        self.requests[h.request_id] = req
        # Zero fresh blocks now, before the KV read lands in them; the READ does not queue
        # behind the compute stream, so the zeroing (and any earlier kernel still writing these
        # blocks for their previous owner) must have run before it is posted: the fence marks
        # the compute stream up to the zeroing, not the whole device (READs in flight).
        self.runner.apply_kv_moves((), self.kv_manager.pop_new_blocks(), ())
        return self.kv_manager.block_table(h.request_id), self.runner.fence()

    def add_handoff(self, h: HandoffMessage) -> BlockTable | None:
        """`place_handoff`, then wait for its fence: a READ may be posted into the blocks at once."""
        placed = self.place_handoff(h)
        if placed is None:
            return None
        table, fence = placed
        fence.wait()
        return table

    def cached_blocks(self, request_id: str) -> int:
        """Decode role: leading blocks of a RECEIVING request that this engine's prefix cache
        already held; its KV read starts after them."""
        return self.scheduler.get_request(request_id).cached_blocks

    def kv_received(self, request_id: str) -> None:
        self.scheduler.kv_received(request_id)

    def kv_failed(self, request_id: str, reason: str) -> None:
        """Decode role: the KV never arrived (the peer is lost or too slow); end the request
        with an UNAVAILABLE error (not the engine's fault), free its blocks."""
        req = self.requests.get(request_id)
        if req is None:
            return
        self.scheduler.abort(request_id)
        req.finish_reason = "error"
        self._pending_outputs.append(req.take_output(error=reason, error_code="UNAVAILABLE"))
        self._retire(request_id)

    def kv_compat(self) -> dict:
        """What a peer engine must match to exchange KV blocks with this one."""
        s = self.model.kv_spec
        return {
            "model": self.config.model, "dtype": self.config.dtype,
            "kv_cache_dtype": self.config.kv_cache_dtype, "kv_scales": self.runner.kv.scale_list(),
            "block_size": self.layout.block_size, "num_flat_layers": s.num_flat_layers,
            "num_looped_layers": s.num_looped_layers, "num_kv_heads": s.num_kv_heads,
            "head_dim": s.head_dim, "max_loops": self.max_loops,
        }

    # ------------------------------------------------------------------ execution
    def _execute(self, batch: ScheduledBatch) -> tuple[BatchResult, UnreadBatch | None]:
        reqs = {i.request_id: self.requests[i.request_id] for i in batch.items}
        tables = {rid: self.kv_manager.block_table(rid) for rid in reqs}
        op = batch.operation
        self.counters.batches[op.value] += 1
        if op is Operation.PRELUDE:
            self.runner.prelude(batch, reqs, tables)
            return BatchResult({i.request_id: ItemResult() for i in batch.items}), None
        if op is Operation.RECURRENT:
            self.counters.loops_run += sum(len(i.positions) for i in batch.items)
            exited = self.runner.recurrent(batch, reqs, tables, self._draft_loops())
            return BatchResult({i.request_id: ItemResult(exited=exited[i.request_id]) for i in batch.items}), None
        logits = self.runner.coda(batch, reqs, tables)
        results, unread = self.acceptance.results(batch.items, reqs, logits)
        return BatchResult(results), unread

    def _draft_loops(self) -> int:
        spec = self.config.scheduler.speculative
        return spec.draft_loops if spec else 0

    # ------------------------------------------------------------------ introspection
    def stats(self) -> EngineStats:
        u = self.kv_manager.usage()
        prefix = self.kv_manager.prefix
        return EngineStats(
            looped=PoolUsage(u.looped.used, u.looped.free, u.looped.total),
            flat=PoolUsage(u.flat.used, u.flat.free, u.flat.total),
            planes=tuple(u.planes), scheduler=self.scheduler.stats(),
            counters=replace(self.counters, batches=dict(self.counters.batches)),
            prefix_cache=PrefixCacheStats(self.kv_manager.prefix_stats.queries, self.kv_manager.prefix_stats.hits,
                                          len(prefix), prefix.num_evicted),
        )

    def check_no_leaks(self) -> None:
        """Pool accounting, and (when idle) every block unreferenced (free, or cached for later
        prompts), every state slab row and unread sample gone."""
        self.kv_manager.check()
        if not self.has_unfinished():
            u = self.kv_manager.usage()
            if u.used_blocks:
                raise AssertionError(f"idle engine still holds KV blocks: {u}")
            if self.runner.states.rows_in_use or self._unread:
                raise AssertionError(f"idle engine still holds {self.runner.states.rows_in_use} state slab rows "
                                     f"and {len(self._unread)} unread samples")

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
