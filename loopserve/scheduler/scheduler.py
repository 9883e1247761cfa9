"""The WorkKey scheduler: admission slots, queues keyed by WorkKey, one single-Operation batch
per step.

Three separate vocabularies: RequestStatus is lifecycle only, WorkKey is a request's one
piece of pending work (the `queues.pending` index), Operation binds a batch to one model
call. `admission_slots` is the set of requests holding an execution slot; it is independent
of lifecycle: a request aborted while its batch is in flight is FINISHED at once but keeps
its slot and blocks until that batch retires. `activate_request()` is the only way into
ACTIVE (admission, PD handoff, resume after preemption).
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Mapping, Set
from dataclasses import dataclass
from types import MappingProxyType

from loopserve.kv_cache import CachedBlock, KVCacheManager
from loopserve.scheduler.batch import (
    BatchResult,
    ScheduledBatch,
    SchedulerOutput,
    UpdateEvents,
)
from loopserve.protocol.stats import SchedulerStats
from loopserve.protocol.status import QueueFullError
from loopserve.scheduler.config import SchedulerConfig
from loopserve.scheduler.policy import POLICIES, Plan
from loopserve.scheduler.preemption import plan_victims
from loopserve.scheduler.progress import AFTER, WORK_KEY, Outcome, begin_unit, check_result, plan
from loopserve.scheduler.queues import RankedFifo, WorkQueues
from loopserve.scheduler.request import RequestState, SchedRequest, Unit
from loopserve.scheduler.types import Operation, RequestStatus, WorkKey

S = RequestStatus
_request_id = operator.attrgetter("request_id")
ADMISSION_SCAN = 64  # waiting requests looked at per step
ADMISSION_BYPASS = 8  # how many may be admitted past a blocked one (so big requests still get in)


@dataclass(frozen=True)
class SchedulerView:
    """The bookkeeping behind the public attributes, read-only, for checks from outside
    (invariants.py); valid until the scheduler's next call."""

    requests: Mapping[str, RequestState]  # every request not yet forgotten
    inflight: tuple[ScheduledBatch, ...]
    landed: Set[str]  # RECEIVING requests whose KV landed, waiting for a slot
    status_counts: Mapping[RequestStatus, int]  # kept incrementally
    live_cohort_rows: int | None  # rows the no_refill cohort gate counts; None without a gate


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        if config.incremental_kv != kv_manager.incremental:
            raise ValueError(
                f"incremental_kv ({config.incremental_kv}) must match the KVCacheManager's "
                f"incremental ({kv_manager.incremental})"
            )
        self.config = config
        self.kv = kv_manager
        self.queues = WorkQueues()
        self.waiting = RankedFifo()  # (rank, resumed first) then FIFO
        self.admission_slots: set[str] = set()
        self._reqs: dict[str, RequestState] = {}
        self._landed: dict[str, RequestState] = {}  # RECEIVING with KV landed, FIFO
        self._inflight: dict[int, ScheduledBatch] = {}
        self.policy = POLICIES[config.policy]()
        self._gate = self.policy.cohort_gate()
        self._served: dict[Plan, int] = {}
        self._counts = {s: 0 for s in S}
        self._status_changes: dict[str, None] | None = None  # see record_status_changes
        self._seq = itertools.count()
        self._next_batch_id = 1
        self._tick = 0
        self._step = 0  # schedule() calls completed
        # per-step outputs
        self._swap_out: list = []
        self._swap_in: list = []
        self._preempted: list[str] = []
        self._freed: list[str] = []
        self._fresh: set[str] = set()  # got KV this step: never a victim in the same step
        self._victim_order: list[RequestState] | None = None
        self.num_preemptions = 0
        self.num_finished = 0
        self.num_aborted = 0

    # ------------------------------------------------------------------ requests in
    def add_request(self, req: SchedRequest) -> None:
        """Queue a request (WAITING); QueueFullError beyond max_waiting."""
        self._check_new(req)
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(
                f"waiting queue is full ({len(self.waiting)} requests, max_waiting="
                f"{self.config.max_waiting}); retry later"
            )
        st = self._new_state(req, S.WAITING)
        self.waiting.add(st, self._waiting_rank(st))

    def add_receiving(self, req: SchedRequest, num_computed_tokens: int) -> bool:
        """Decode role: blocks for a prefilled request whose KV is about to be read (RECEIVING,
        no slot), starting from the prompt's cached prefix (`cached_blocks`: not read). False
        when the blocks are not free now (nothing is allocated)."""
        if self.config.role != "decode":
            raise ValueError(f"add_receiving needs role='decode', this scheduler is role={self.config.role!r}")
        self._check_new(req)
        p, n = req.prompt_len, num_computed_tokens
        if not isinstance(n, int) or not p <= n <= p + req.max_tokens - 2:
            raise ValueError(
                f"{req.request_id}: num_computed_tokens must be in [prompt_len ({p}), prompt_len + "
                f"max_tokens - 2 ({p + req.max_tokens - 2})], got {n!r}"
            )
        tokens = n if self.config.incremental_kv else self._lifetime_tokens(req)
        prefix = self.kv.cached_prefix(req.block_hashes, p) if req.block_hashes else []
        if not self.kv.allocate(req.request_id, tokens, req.planes, prefix):
            return False
        st = self._new_state(req, S.RECEIVING)
        st.done, st.n_out = n, n - p + 1  # the first token was sampled on the prefill side
        st.cached_blocks = len(prefix)  # the KV read skips these
        if req.block_hashes is not None:
            self.kv.prefix_stats.queries += p
            self.kv.prefix_stats.hits += len(prefix) * self.kv.layout.block_size
        return True

    def kv_received(self, request_id: str) -> bool:
        """Decode role: the KV landed; the request is activated when a slot is free."""
        st = self._reqs.get(request_id)
        if st is None:
            return False  # aborted meanwhile
        if st.status is not S.RECEIVING:
            raise ValueError(f"kv_received({request_id!r}): request is {st.status.value}, not RECEIVING")
        st.kv_landed = True
        self._landed[request_id] = st
        return True

    def transfer_done(self, request_id: str) -> bool:
        """Prefill role: the reader confirmed; FINISHED and blocks freed."""
        st = self._reqs.get(request_id)
        if st is None:
            return False
        if st.status is not S.TRANSFERRING:
            raise ValueError(f"transfer_done({request_id!r}): request is {st.status.value}, not TRANSFERRING")
        self._finish(st)
        return True

    def abort(self, request_id: str) -> bool:
        """Abort at any status. Resources of a request in flight go when its batch retires."""
        return self._end(request_id, aborted=True)

    def abort_all(self) -> None:
        """Abort every request and retire every batch in flight without a result: the engine
        failed, so none of them will run. Frees every slot and block."""
        for rid in list(self._reqs):
            self._end(rid, aborted=True)
        for batch in list(self._inflight.values()):
            self.update(batch, BatchResult({}))

    def stop(self, request_id: str) -> bool:
        """Finish a request on a stop condition the engine saw outside a batch result (a
        sample read back after the request's next work was scheduled). As abort(), but it
        counts as finished. False when the request was already finished or unknown."""
        return self._end(request_id, aborted=False)

    def _end(self, request_id: str, aborted: bool) -> bool:
        st = self._reqs.get(request_id)
        if st is None or st.status is S.FINISHED:
            return False
        if st.status is S.ACTIVE and request_id in self.queues:
            self._unqueue(st)
        elif st.status is S.WAITING:
            self.waiting.remove(request_id, self._waiting_rank(st))
        elif st.status is S.RECEIVING:
            self._landed.pop(request_id, None)
        self._set_status(st, S.FINISHED)
        if aborted:
            self.num_aborted += 1
        else:
            self.num_finished += 1
        if not st.in_flight:
            self._release(st)
        return True

    def _check_new(self, req: SchedRequest) -> None:
        if not isinstance(req, SchedRequest):
            raise ValueError(f"expected a SchedRequest, got {type(req).__name__}")
        if req.request_id in self._reqs:
            raise ValueError(f"request_id {req.request_id!r} is already scheduled")
        self.kv.check_fits(req.request_id, self._lifetime_tokens(req), req.planes)

    def _lifetime_tokens(self, req: SchedRequest) -> int:
        """Full reservation: the prompt plus every output token (a prefill engine only the prompt)."""
        return req.prompt_len if self.config.role == "prefill" else req.prompt_len + req.max_tokens

    def _new_state(self, req: SchedRequest, status: RequestStatus) -> RequestState:
        st = RequestState(req, next(self._seq), self.policy.rank(req), status)
        self._reqs[req.request_id] = st
        self._counts[status] += 1
        self._note_status(st)
        return st

    @staticmethod
    def _waiting_rank(st: RequestState) -> tuple[int, int]:
        return (st.rank, 0 if st.num_preemptions else 1)  # preempted requests resume first

    # ------------------------------------------------------------------ lifecycle primitives
    def activate_request(self, request_id: str) -> None:
        """The only path to ACTIVE: reserve a slot and queue the request's pending work."""
        st = self._reqs[request_id]
        if st.status is S.WAITING:
            rank = self._waiting_rank(st)
        elif st.status is S.RECEIVING and st.kv_landed:
            rank = None
        else:
            raise RuntimeError(f"activate_request({request_id!r}): request is {st.status.value}")
        if len(self.admission_slots) >= self.config.max_num_seqs:
            raise RuntimeError(f"activate_request({request_id!r}): all {self.config.max_num_seqs} slots held")
        if not self.kv.has(request_id):
            raise RuntimeError(f"activate_request({request_id!r}): its KV is not resident")
        if rank is None:
            del self._landed[request_id]
        else:
            self.waiting.remove(request_id, rank)
        self.admission_slots.add(request_id)
        self._set_status(st, S.ACTIVE)
        if st.unit is None:
            begin_unit(st, self.config)
        self._push([st])

    def _set_status(self, st: RequestState, status: RequestStatus) -> None:
        self._counts[st.status] -= 1
        self._counts[status] += 1
        st.status = status
        self._note_status(st)

    def _note_status(self, st: RequestState) -> None:
        if self._status_changes is not None:
            self._status_changes[st.request_id] = None

    def _push(self, sts: list[RequestState]) -> None:
        """Queue each request's pending work, ready now."""
        tick, step = self._tick, self._step
        keys = []
        for st in sts:
            st.ready_tick = tick
            st.ready_step = step
            keys.append(WORK_KEY[st.unit][st.phase])
        self.queues.push(sts, keys)
        if self._gate is not None:
            for st, key in zip(sts, keys):
                if st.phase is Operation.RECURRENT:
                    self._gate.enter(key, st.cohort)

    def _unqueue(self, st: RequestState) -> None:
        """Drop pending work that will not run now (preemption, abort); batches use select()."""
        key = self.queues.take(st)
        if self._gate is not None and st.phase is Operation.RECURRENT:
            self._gate.leave(key, st.cohort)

    def _finish(self, st: RequestState) -> None:
        self._set_status(st, S.FINISHED)
        self.num_finished += 1
        self._release(st)

    def _release(self, st: RequestState) -> None:
        """Give back slot and blocks and forget the request (nothing in flight holds it)."""
        rid = st.request_id
        self.admission_slots.discard(rid)
        if self.kv.free(rid):
            self._freed.append(rid)
        self._counts[st.status] -= 1
        del self._reqs[rid]

    def _suspend(self, st: RequestState) -> None:
        """Preempt an ACTIVE request: its pending work stays in its progress fields (the
        snapshot, taken once), it yields the slot and waits; KV stays unless offloaded."""
        rid = st.request_id
        self._unqueue(st)
        self.admission_slots.discard(rid)
        self._set_status(st, S.WAITING)
        st.num_preemptions += 1
        self.waiting.add(st, self._waiting_rank(st))
        self._preempted.append(rid)
        self.num_preemptions += 1

    def _offload(self, st: RequestState) -> None:
        rid = st.request_id
        self._swap_out.append((rid, self.kv.block_table(rid).copy()))
        st.offloaded_tokens = self.kv.capacity(rid)
        self.kv.free(rid)

    # ------------------------------------------------------------------ step
    def schedule(self) -> SchedulerOutput:
        """Admit/resume, then form one batch (None when no pending work can run)."""
        self._tick += 1
        self._fresh.clear()
        self._victim_order = None
        self._admit()
        batch = self._form_batch()
        self._step += 1
        out = SchedulerOutput(batch, tuple(self._swap_out), tuple(self._swap_in),
                              tuple(self._preempted), tuple(self._freed))
        self._swap_out, self._swap_in, self._preempted, self._freed = [], [], [], []
        return out

    def update(self, batch: ScheduledBatch, result: BatchResult) -> UpdateEvents:
        """Retire a batch: advance each request from the engine's results."""
        if self._inflight.get(batch.batch_id) is not batch:
            raise ValueError(f"batch {batch.batch_id} is not in flight (retired twice, or foreign)")
        op, items, results, reqs = batch.operation, batch.items, result.items, self._reqs
        if not all(map(results.__contains__, map(_request_id, items))):
            missing = [i.request_id for i in items
                       if i.request_id not in results and reqs[i.request_id].status is not S.FINISHED]
            if missing:  # (an item aborted in flight needs no result)
                raise ValueError(f"batch {batch.batch_id}: no result for {missing}")
        if op is not Operation.PRELUDE:  # validate everything before changing anything
            for item in items:  # (one sampled token, or no exits, needs no closer look)
                res = results.get(item.request_id)
                if res is not None and (res.exited or (item.logits_positions and (item.verify or len(res.sampled) != 1))):
                    st = reqs[item.request_id]
                    if st.status is not S.FINISHED:
                        check_result(st, item, op, res)
        del self._inflight[batch.batch_id]
        self._tick += 1
        events = UpdateEvents()
        gate = self._gate if op is Operation.RECURRENT else None
        after = AFTER[op]
        cfg, bid = self.config, batch.batch_id
        cont: list[RequestState] = []
        finished, going_on = S.FINISHED, Outcome.CONTINUE
        for item in items:
            rid = item.request_id
            st = reqs[rid]
            st.in_flight = 0
            if gate is not None:
                gate.leave(item.work_key, st.cohort)
            if st.status is finished:  # aborted while in flight
                self._release(st)
                continue
            res = results[rid]
            outcome = Outcome.FINISHED if res.finished else after(st, item, res, cfg, bid)
            keys = st.request.block_hashes
            if keys and st.cached_blocks < len(keys) and op is not Operation.PRELUDE:
                self._cache_prompt_blocks(st, keys, op, res.finished)
            if outcome is going_on:
                cont.append(st)
            elif outcome is Outcome.FINISHED:
                self._finish(st)
                events.finished.append(rid)
            else:
                self.admission_slots.discard(rid)
                self._set_status(st, S.TRANSFERRING)
                events.transferring.append(rid)
        self._push(cont)
        return events

    def _cache_prompt_blocks(self, st: RequestState, keys: tuple[bytes, ...], op: Operation,
                             finished: bool) -> None:
        """Index the prompt's full blocks whose K/V is now complete on every plane."""
        done = st.done
        if finished and op is Operation.CODA and st.unit in (Unit.ATOMIC, Unit.CHUNK):
            done = st.rows[-1] + 1  # the prompt's last coda ran; nothing advanced `done`
        n = min(len(keys), done // self.kv.layout.block_size)
        if n > st.cached_blocks:
            self.kv.cache_blocks(st.request_id, keys[:n], st.cached_blocks)
            st.cached_blocks = n

    # ------------------------------------------------------------------ admission
    def _admit(self) -> None:
        cfg, slots = self.config, self.admission_slots
        while self._landed and len(slots) < cfg.max_num_seqs:
            self.activate_request(next(iter(self._landed)))
        if not self.waiting:
            return
        can_preempt = self.policy.preempts
        bypass_left: int | None = None
        for st in list(itertools.islice(self.waiting, ADMISSION_SCAN)):
            need_slot = len(slots) >= cfg.max_num_seqs
            if need_slot and not can_preempt:
                break
            prefix = self._admission_prefix(st)
            tokens = self._admission_tokens(st, len(prefix))
            short = self.kv.shortfall(st.request_id, tokens, st.request.planes, prefix)
            if need_slot or short[0] > 0 or short[1] > 0:
                if short[0] > 0 or short[1] > 0:
                    # Victims may hold the prefix's blocks: free room for the whole run.
                    short = self.kv.shortfall(st.request_id, tokens, st.request.planes)
                if not (can_preempt and self._make_room(st, need_slot, short, admission=True)):
                    can_preempt = False  # requests behind it rank no better: one failed dry run per step
                    if need_slot:
                        break
                    bypass_left = ADMISSION_BYPASS if bypass_left is None else bypass_left
                    continue
            self._load_kv(st)
            self.activate_request(st.request_id)
            if bypass_left is not None:
                bypass_left -= 1
                if bypass_left == 0:
                    break

    def _admission_prefix(self, st: RequestState) -> list[CachedBlock]:
        """Cached blocks a first admission starts from (none for a resident or offloaded run)."""
        req = st.request
        if not req.block_hashes or st.done or st.offloaded_tokens or self.kv.has(st.request_id):
            return []
        return self.kv.cached_prefix(req.block_hashes, req.prompt_len)

    def _admission_tokens(self, st: RequestState, cached_blocks: int) -> int:
        """Positions to hold before activation: nothing if resident, the offloaded run, the
        whole lifetime (full reservation) or the cached prefix and first unit (incremental)."""
        if self.kv.has(st.request_id):
            return 0
        if st.offloaded_tokens:
            return st.offloaded_tokens
        req = st.request
        if not self.config.incremental_kv:
            return self._lifetime_tokens(req)
        cached = cached_blocks * self.kv.layout.block_size
        return min(req.prompt_len, cached + (self.config.prefill_chunk_size or req.prompt_len))

    def _load_kv(self, st: RequestState) -> None:
        prefix = self._admission_prefix(st)
        tokens = self._admission_tokens(st, len(prefix))
        if not tokens:
            return
        rid, req = st.request_id, st.request
        if not self.kv.allocate(rid, tokens, req.planes, prefix):
            raise RuntimeError(f"{rid}: blocks vanished between the check and the allocation")
        if req.block_hashes is not None and not st.done and not st.offloaded_tokens:
            # A first admission: the cached prefix's prompt work (every loop of it) is skipped.
            st.cached_blocks = len(prefix)
            st.done = len(prefix) * self.kv.layout.block_size
            self.kv.prefix_stats.queries += req.prompt_len
            self.kv.prefix_stats.hits += st.done
        if st.offloaded_tokens:
            self._swap_in.append((rid, self.kv.block_table(rid).copy()))
            st.offloaded_tokens = 0
        self._fresh.add(rid)

    # ------------------------------------------------------------------ preemption
    def _make_room(self, st: RequestState, need_slot: bool, short: tuple[int, int],
                   admission: bool) -> bool:
        """Preempt victims ranked below `st` so it gets a slot and/or `short` blocks.

        Admission (a policy that preempts) takes strictly lower-ranked victims; KV growth takes
        any resident request ranked below (priority, then arrival). A slot victim yields per
        preemption_mode; victims whose blocks are needed are offloaded.
        """
        plan_ = plan_victims(self._victims_below(st, admission), self._resident_blocks, need_slot,
                             short, self.config.preemption_mode == "offload")
        if plan_ is None:
            return False
        if plan_.slot is not None:
            self._suspend(plan_.slot)
        for v in plan_.offload:
            if v.status is S.ACTIVE:
                self._suspend(v)
            self._offload(v)
        return True

    def _victims_below(self, st: RequestState, admission: bool) -> Iterator[RequestState]:
        """Eligible victims worse than `st`, worst first: not in flight, KV resident, not
        given KV this step (its swap must not meet another in one step's moves)."""
        if self._victim_order is None:  # sorted once per step, filtered as statuses change
            self._victim_order = sorted(self._reqs.values(), key=lambda v: (v.rank, v.seq), reverse=True)
        me = (st.rank, st.seq)
        for v in self._victim_order:
            if (v.rank, v.seq) <= me or (admission and v.rank <= st.rank):
                return
            if (v.status is S.ACTIVE and not v.in_flight) or v.status is S.WAITING:
                rid = v.request_id
                if rid not in self._fresh and self.kv.has(rid):
                    yield v

    def _resident_blocks(self, st: RequestState) -> tuple[int, int]:
        """What preempting `st` frees: blocks other tables share stay."""
        return self.kv.exclusive_blocks(st.request_id)

    def _grow(self, st: RequestState, tokens: int) -> bool:
        """Incremental KV: cover `tokens` positions, preempting by capacity if blocks are short."""
        rid = st.request_id
        if self.kv.capacity(rid) >= tokens or self.kv.allocate(rid, tokens, st.request.planes):
            return True
        if not self._make_room(st, False, self.kv.shortfall(rid, tokens, st.request.planes),
                               admission=False):
            return False
        if not self.kv.allocate(rid, tokens, st.request.planes):
            raise RuntimeError(f"{rid}: blocks vanished between the preemption and the allocation")
        return True

    # ------------------------------------------------------------------ batch forming
    def _form_batch(self) -> ScheduledBatch | None:
        for plan_ in self.policy.order_plans(self.queues, self._served, self._step,
                                             self.config.max_wait_steps):
            batch = self._fill(plan_)
            if batch is not None:
                self._served[plan_] = self._tick
                self._inflight[batch.batch_id] = batch
                return batch
        return None

    def _fill(self, plan_: Plan) -> ScheduledBatch | None:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        op = plan_.operation
        grow = cfg.incremental_kv and op is Operation.PRELUDE
        batch_id = self._next_batch_id
        items = []
        active = S.ACTIVE
        for lane in plan_.lanes:
            key = lane[0]
            cohort = self._gate.oldest(key) if self._gate is not None and op is Operation.RECURRENT else None
            chosen = []
            for st in self.queues.lanes[lane].snapshot():
                if budget <= 0:
                    break
                if st.status is not active:  # preempted by an earlier item's KV growth
                    continue
                if cohort is not None and st.cohort != cohort:
                    continue
                item = plan(st, cfg, budget)
                n = len(item.positions)
                if n > budget and (items or key is not WorkKey.PROMPT_ATOMIC):
                    continue  # only an atomic prompt may exceed the budget, alone
                if grow and not self._grow(st, item.positions[-1] + 1):
                    continue
                st.in_flight = batch_id
                chosen.append(st)
                items.append(item)
                budget -= n
            if chosen:
                self.queues.select(lane, chosen)
        if not items:
            return None
        self._next_batch_id += 1
        return ScheduledBatch(batch_id, op, tuple(items))

    # ------------------------------------------------------------------ introspection
    def get_request(self, request_id: str) -> RequestState | None:
        return self._reqs.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self._reqs)

    def record_status_changes(self) -> None:
        """Note from now on which requests got a status (new, or changed), for a caller that
        follows statuses (`take_status_changes`) without reading every request each step."""
        self._status_changes = {}

    def take_status_changes(self) -> list[str]:
        """Ids whose status was set since the last take, in order of their first change."""
        if self._status_changes is None:
            raise RuntimeError("record_status_changes() first")
        out, self._status_changes = list(self._status_changes), {}
        return out

    def load(self) -> tuple[int, int]:
        """(WAITING, ACTIVE) request counts: what a worker reports each step, without the
        rest of stats()."""
        return self._counts[S.WAITING], self._counts[S.ACTIVE]

    def stats(self) -> SchedulerStats:
        c = self._counts
        return SchedulerStats(
            num_waiting=c[S.WAITING], num_running=c[S.ACTIVE], num_receiving=c[S.RECEIVING],
            num_transferring=c[S.TRANSFERRING], num_slots=len(self.admission_slots),
            num_pending=len(self.queues), num_inflight_batches=len(self._inflight),
            num_preemptions=self.num_preemptions, num_finished=self.num_finished,
            num_aborted=self.num_aborted,
            pending={f"{k.value}/{o.value}": len(q) for (k, o), q in self.queues.lanes.items() if len(q)},
        )

    def view(self) -> SchedulerView:
        """What a check from outside reads, without reaching into private fields."""
        return SchedulerView(MappingProxyType(self._reqs), tuple(self._inflight.values()),
                             self._landed.keys(), MappingProxyType(self._counts),
                             self._gate.num_live() if self._gate is not None else None)
