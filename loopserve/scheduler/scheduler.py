"""The WorkKey scheduler: one single-Operation batch per step.

Lifecycle (RequestStatus) and pending work (WorkKey) are separate: a request has at most one
pending WorkKey (the `pending` index), admission slots are a set of request ids, and
`activate_request()` is the only way into ACTIVE.
"""

from __future__ import annotations

import itertools

from loopserve.kv_cache import KVCacheManager
from loopserve.scheduler.batch import (
    BatchItem,
    BatchResult,
    ItemResult,
    QueueFullError,
    ScheduledBatch,
    SchedulerOutput,
    UpdateEvents,
)
from loopserve.scheduler.config import SchedulerConfig
from loopserve.scheduler.request import SchedRequest, SpecRound, Work
from loopserve.scheduler.types import FIXED_OPERATION, Operation, RequestStatus, WorkKey

S, K, Op = RequestStatus, WorkKey, Operation
PROMPT_KEYS = (K.PROMPT_ATOMIC, K.PROMPT_PRELUDE, K.PROMPT_RECURRENT)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.requests: dict[str, SchedRequest] = {}
        self.waiting: dict[str, None] = {}  # ordered: FIFO (priority policy sorts on admission)
        self.queues: dict[WorkKey, dict[str, None]] = {k: {} for k in WorkKey}
        self.pending: dict[str, WorkKey] = {}  # the one pending WorkKey of each request
        self.admission_slots: set[str] = set()
        self.receiving: dict[str, None] = {}
        self.transferring: set[str] = set()
        self.cohort: set[str] = set()  # no_refill: the decode cohort now looping
        self._batch_ids = itertools.count()
        self._seq = itertools.count()
        self._prompt_turn = False  # fairness: alternate prompt and decode batches
        self._swap_out: list = []
        self._swap_in: list = []
        self._preempted: list[str] = []
        self._fresh: set[str] = set()  # got blocks this step: not evictable until the next
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queue primitives
    def _push(self, req: SchedRequest, work: Work) -> None:
        if req.request_id in self.pending:
            raise RuntimeError(f"{req.request_id} already has pending work {self.pending[req.request_id]}")
        req.work = work
        self.pending[req.request_id] = work.key
        self.queues[work.key][req.request_id] = None

    def _pop(self, rid: str) -> Work:
        key = self.pending.pop(rid, None)
        if key is None:
            raise RuntimeError(f"request {rid} selected twice or has no pending work")
        del self.queues[key][rid]
        work, self.requests[rid].work = self.requests[rid].work, None
        return work

    # ------------------------------------------------------------------ lifecycle
    def add_request(self, req: SchedRequest) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already scheduled")
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFullError(f"waiting queue is full (max_waiting={self.config.max_waiting})")
        req.status, req.seq = S.WAITING, next(self._seq)
        self.requests[req.request_id] = req
        self.waiting[req.request_id] = None

    def activate_request(self, req: SchedRequest) -> bool:
        """The one path into ACTIVE: reserves an admission slot (admission, PD handoff, resume)."""
        if len(self.admission_slots) >= self.config.max_num_seqs:
            return False
        self.admission_slots.add(req.request_id)
        req.status = S.ACTIVE
        return True

    def add_receiving(self, req: SchedRequest, num_computed_tokens: int) -> bool:
        """Decode role: blocks for a prefilled request, no slot until its KV lands."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already scheduled")
        need = req.total_tokens if not self.config.incremental_kv else num_computed_tokens + 1
        if not self.kv.allocate(req.request_id, need, req.planes):
            return False
        req.status, req.seq, req.num_output = S.RECEIVING, next(self._seq), 1
        req.prefilled = req.prompt_len
        self.requests[req.request_id] = req
        self.receiving[req.request_id] = None
        return True

    def kv_received(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and req.status is S.RECEIVING:
            req.kv_ready = True

    def transfer_done(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and req.status is S.TRANSFERRING:
            self._finish(req)

    def abort(self, request_id: str) -> bool:
        req = self.requests.get(request_id)
        if req is None:
            return False
        req.aborted = True
        if request_id in self.pending:
            self._pop(request_id)
        self.waiting.pop(request_id, None)
        self.receiving.pop(request_id, None)
        if req.in_flight:  # resources go when the batch holding it retires
            req.status = S.FINISHED
        else:
            self._finish(req)
        return True

    def _finish(self, req: SchedRequest) -> None:
        rid = req.request_id
        req.status = S.FINISHED
        self.admission_slots.discard(rid)
        self.transferring.discard(rid)
        self.cohort.discard(rid)
        self.kv.free(rid)
        self.requests.pop(rid, None)

    def get_request(self, request_id: str) -> SchedRequest | None:
        return self.requests.get(request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ------------------------------------------------------------------ work construction
    def _first_prompt_work(self, req: SchedRequest) -> Work:
        if self.config.split_prefill:
            end = min(req.prompt_len, req.prefilled + self.config.prefill_chunk_size)
            return Work(K.PROMPT_PRELUDE, Op.PRELUDE, tuple(range(req.prefilled, end)))
        return Work(K.PROMPT_ATOMIC, Op.PRELUDE, tuple(range(req.prompt_len)))

    def _decode_work(self, req: SchedRequest) -> Work:
        p = req.next_decode_position
        spec = self.config.speculative
        if spec is not None and req.greedy and self.config.role != "prefill":
            k = min(spec.num_draft_tokens, req.max_tokens - req.num_output)
            if k >= 2:
                req.spec = SpecRound(start=p, k=k)
                return Work(K.SPECULATIVE, Op.PRELUDE, (p,), draft=True)
        return Work(K.DECODE_PRELUDE, Op.PRELUDE, (p,))

    def _coda_work(self, req: SchedRequest, key: WorkKey, positions: tuple[int, ...]) -> Work | None:
        """CODA after a prompt chunk's loops; None when the chunk needs no coda."""
        last = positions[-1] == req.prompt_len - 1
        if not self.config.coda_writes_kv:
            if not last:
                return None
            positions = (positions[-1],)
        ckey = K.PROMPT_ATOMIC if key is K.PROMPT_ATOMIC else K.DECODE_CODA
        return Work(ckey, Op.CODA, positions, logits_positions=(req.prompt_len - 1,) if last else ())

    # ------------------------------------------------------------------ result handling
    def update(self, batch: ScheduledBatch, result: BatchResult) -> UpdateEvents:
        """Retire a batch: advance every request's pending work from the engine's results."""
        events = UpdateEvents()
        for item in batch.items:
            req = self.requests.get(item.request_id)
            if req is None:
                continue
            req.in_flight = False
            if req.aborted:
                self._finish(req)
                events.finished.append(req.request_id)
                continue
            res = result.items.get(item.request_id, ItemResult())
            if batch.operation is Op.PRELUDE:
                self._push(req, Work(self._recurrent_key(item.work_key), Op.RECURRENT, item.positions,
                                     depth=1, draft=item.draft))
            elif batch.operation is Op.RECURRENT:
                self._after_loop(req, item, res)
            else:
                self._after_coda(req, item, res, events)
        return events

    @staticmethod
    def _recurrent_key(key: WorkKey) -> WorkKey:
        return {K.PROMPT_PRELUDE: K.PROMPT_RECURRENT, K.DECODE_PRELUDE: K.DECODE_RECURRENT}.get(key, key)

    def _after_loop(self, req: SchedRequest, item: BatchItem, res: ItemResult) -> None:
        exited = set(res.exited)
        left = tuple(p for p in item.positions if p not in exited)
        if item.depth >= req.max_loops:
            left = ()  # every row exits at max_loops
        key = item.work_key
        if item.draft and left and item.depth >= self.config.speculative.draft_loops:
            req.spec.unfinished.extend(left)  # stops at draft depth, not a final exit
            left = ()
        if left:
            self._push(req, Work(key, Op.RECURRENT, left, depth=item.depth + 1, draft=item.draft))
            return
        self.cohort.discard(req.request_id)
        if key is K.SPECULATIVE:
            p = item.positions[-1] if item.draft else req.spec.start
            if item.draft:
                self._push(req, Work(K.SPECULATIVE, Op.CODA, (p,), logits_positions=(p,), draft=True))
            else:
                self._push(req, self._verify_coda(req))
        elif key in (K.PROMPT_ATOMIC, K.PROMPT_RECURRENT):
            chunk = self._chunk_positions(req)
            work = self._coda_work(req, key, chunk)
            if work is None:
                self._chunk_done(req, chunk)
            else:
                self._push(req, work)
        else:
            p = item.positions[0]
            self._push(req, Work(K.DECODE_CODA, Op.CODA, (p,), logits_positions=(p,)))

    def _chunk_positions(self, req: SchedRequest) -> tuple[int, ...]:
        if not self.config.split_prefill:
            return tuple(range(req.prompt_len))
        end = min(req.prompt_len, req.prefilled + self.config.prefill_chunk_size)
        return tuple(range(req.prefilled, end))

    def _verify_coda(self, req: SchedRequest) -> Work:
        r = req.spec
        pos = tuple(range(r.start, r.start + r.k))
        return Work(K.SPECULATIVE, Op.CODA, pos, logits_positions=pos, verify=True)

    def _chunk_done(self, req: SchedRequest, chunk: tuple[int, ...]) -> None:
        req.prefilled = chunk[-1] + 1
        if req.prefilled < req.prompt_len:
            self._push(req, self._first_prompt_work(req))

    def _after_coda(self, req: SchedRequest, item: BatchItem, res: ItemResult, events: UpdateEvents) -> None:
        if item.work_key in PROMPT_KEYS or (item.work_key is K.DECODE_CODA and req.prefilled < req.prompt_len):
            self._chunk_done(req, self._chunk_positions(req))
            if req.prefilled < req.prompt_len:
                return
        elif item.draft:
            r = req.spec
            r.drafted += 1
            if r.drafted < r.k:
                p = r.start + r.drafted
                self._push(req, Work(K.SPECULATIVE, Op.PRELUDE, (p,), draft=True))
            elif r.unfinished:
                rows = tuple(sorted(r.unfinished))
                r.unfinished = []
                self._push(req, Work(K.SPECULATIVE, Op.RECURRENT, rows,
                                     depth=self.config.speculative.draft_loops + 1))
            else:
                self._push(req, self._verify_coda(req))
            return
        # a token was produced (the prompt's first, a decode token, or a verified run)
        req.spec = None
        req.num_output += max(1, len(res.sampled))
        if res.finished or req.num_output >= req.max_tokens:
            self._finish(req)
            events.finished.append(req.request_id)
        elif self.config.role == "prefill":
            req.status = S.TRANSFERRING
            self.admission_slots.discard(req.request_id)
            self.transferring.add(req.request_id)
            events.transferring.append(req.request_id)
        else:
            self._push(req, self._decode_work(req))

    # ------------------------------------------------------------------ admission & preemption
    def _kv_need(self, req: SchedRequest) -> int:
        """Tokens to reserve at admission: the whole lifetime, or (incremental) the first chunk."""
        if not self.config.incremental_kv:
            return req.total_tokens
        if self.config.split_prefill:
            return min(req.prompt_len, req.prefilled + self.config.prefill_chunk_size)
        return req.prompt_len

    def _admit(self) -> None:
        for rid in [r for r in self.receiving if self.requests[r].kv_ready]:
            req = self.requests[rid]
            if not self.activate_request(req):
                break
            del self.receiving[rid]
            self._push(req, self._decode_work(req))
        order = list(self.waiting)
        if self.config.policy == "priority":
            order.sort(key=lambda r: (self.requests[r].priority, self.requests[r].seq))
            self._priority_preempt(order)
        blocked = 0
        for rid in order[: self.config.admission_scan]:
            if len(self.admission_slots) >= self.config.max_num_seqs or blocked > self.config.admission_bypass:
                break
            req = self.requests[rid]
            if not self._ensure_resident(req):
                blocked += 1
                continue
            self.activate_request(req)
            del self.waiting[rid]
            work, req.snapshot = req.snapshot, None
            self._push(req, work or self._first_prompt_work(req))

    def _ensure_resident(self, req: SchedRequest) -> bool:
        """KV for a request being admitted or resumed (restoring an offloaded one)."""
        if self.kv.has(req.request_id) and not req.offloaded:
            return True
        need = req.offload_tokens if req.offloaded else self._kv_need(req)
        while not self.kv.allocate(req.request_id, need, req.planes):
            if not self._capacity_preempt(req):
                return False
        if req.offloaded:
            self._swap_in.append((req.request_id, self.kv.block_table(req.request_id).copy()))
            req.offloaded = False
        self._fresh.add(req.request_id)
        return True

    def _capacity_preempt(self, req: SchedRequest) -> bool:
        """Offload the least important resident request ranked below `req` (priority, then
        arrival). Ranking victims strictly below the requester rules out eviction ping-pong:
        the top-ranked request can always run."""
        rank = (req.priority, req.seq)
        victims = [r for r in self.requests.values()
                   if (r.priority, r.seq) > rank and not r.in_flight and not r.offloaded
                   and r.request_id not in self._fresh  # KV moves of one step never cross
                   and r.status in (S.ACTIVE, S.WAITING) and self.kv.has(r.request_id)]
        if not victims:
            return False
        self._suspend(max(victims, key=lambda r: (r.priority, r.seq)), offload=True)
        return True

    def _priority_preempt(self, order: list[str]) -> None:
        if len(self.admission_slots) < self.config.max_num_seqs:
            return
        for rid in order[:1]:
            cand = self.requests[rid]
            running = [self.requests[r] for r in self.admission_slots
                       if self.requests[r].status is S.ACTIVE and not self.requests[r].in_flight]
            if not running:
                return
            worst = max(running, key=lambda r: (r.priority, r.seq))
            if worst.priority > cand.priority:
                self._suspend(worst, offload=self.config.preemption_mode == "offload")

    def _suspend(self, req: SchedRequest, offload: bool) -> None:
        """Yield the slot (keeping the pending work as a snapshot) and optionally offload KV."""
        rid = req.request_id
        if req.status is S.ACTIVE:
            if req.snapshot is None:
                req.snapshot = self._pop(rid) if rid in self.pending else None
            self.admission_slots.discard(rid)
            self.cohort.discard(rid)
            req.status = S.WAITING
            self.waiting = {rid: None, **self.waiting}  # resumes first among its peers
            self.num_preemptions += 1
            self._preempted.append(rid)
        if offload and self.kv.has(rid):
            self._swap_out.append((rid, self.kv.block_table(rid).copy()))
            req.offload_tokens = self.kv.capacity(rid)
            req.offloaded = True
            self.kv.free(rid)

    # ------------------------------------------------------------------ selection
    def schedule(self) -> SchedulerOutput:
        self._admit()
        batch = self._select()
        out = SchedulerOutput(batch, tuple(self._swap_out), tuple(self._swap_in), tuple(self._preempted))
        self._swap_out, self._swap_in, self._preempted = [], [], []
        self._fresh.clear()
        return out

    def _candidates(self, keys: tuple[WorkKey, ...], op: Operation) -> list[str]:
        rids = [r for k in keys for r in self.queues[k] if self.requests[r].work.op is op]
        if self.config.policy == "priority":
            rids.sort(key=lambda r: (self.requests[r].priority, self.requests[r].seq))
        return rids

    def _select(self) -> ScheduledBatch | None:
        """The first plan that forms a batch; decode and prompt plans alternate when both exist."""
        decode, prompt = self._decode_plans(), self._prompt_plans()
        if decode and prompt:
            self._prompt_turn = not self._prompt_turn
            plans = prompt + decode if self._prompt_turn else decode + prompt
        else:
            plans = decode + prompt
        for op, rids in plans:
            batch = self._build(op, rids)
            if batch is not None:
                return batch
        return None

    def _decode_plans(self) -> list[tuple[Operation, list[str]]]:
        dec = (K.DECODE_PRELUDE, K.DECODE_RECURRENT, K.DECODE_CODA, K.SPECULATIVE)
        mixed = self.config.policy == "mixed"
        plans = []
        if mixed:
            pr = self._candidates((K.PROMPT_RECURRENT,), Op.RECURRENT)
            dr = self._candidates((K.DECODE_RECURRENT,), Op.RECURRENT)
            if pr and dr:  # the mixed recurrent batch comes first
                plans.append((Op.RECURRENT, dr + pr))
        for op in (Op.CODA, Op.PRELUDE, Op.RECURRENT):
            rids = self._candidates(dec, op)
            if op is Op.RECURRENT and self.config.policy == "no_refill":
                rids = self._cohort_filter(rids)
            if mixed and op is not Op.CODA:
                rids = rids + self._candidates((K.PROMPT_PRELUDE if op is Op.PRELUDE else K.PROMPT_RECURRENT,), op)
            if rids:
                plans.append((op, rids))
        return plans

    def _cohort_filter(self, rids: list[str]) -> list[str]:
        spec_or_prompt = [r for r in rids if self.pending[r] is not K.DECODE_RECURRENT]
        decode = [r for r in rids if self.pending[r] is K.DECODE_RECURRENT]
        if not self.cohort:
            self.cohort = set(decode)
        return [r for r in decode if r in self.cohort] + spec_or_prompt

    def _prompt_plans(self) -> list[tuple[Operation, list[str]]]:
        if self.config.policy == "mixed":
            return []  # prompt work rides in the decode plans' mixed batches
        plans = []
        for op in (Op.CODA, Op.RECURRENT, Op.PRELUDE):  # finish started prompts first
            rids = self._candidates((K.PROMPT_ATOMIC,), op)
            if self.config.split_prefill:
                keys = {Op.PRELUDE: (K.PROMPT_PRELUDE,), Op.RECURRENT: (K.PROMPT_RECURRENT,), Op.CODA: ()}[op]
                rids += self._candidates(keys, op)
            if rids:
                plans.append((op, rids))
        return plans

    def _build(self, op: Operation, rids: list[str]) -> ScheduledBatch | None:
        budget = self.config.max_num_batched_tokens
        items: list[BatchItem] = []
        used = 0
        for rid in rids:
            if rid not in self.pending:  # suspended by a capacity preemption just now
                continue
            req = self.requests[rid]
            work = req.work
            n = len(work.positions)
            if items and used + n > budget:
                continue
            if items and (work.key is K.PROMPT_ATOMIC) != (items[0].work_key is K.PROMPT_ATOMIC):
                continue  # atomic prompts never share a batch with other work
            need = work.positions[-1] + 1
            if self.config.incremental_kv and need > self.kv.capacity(rid) and not self._grow(req, need):
                continue
            work = self._pop(rid)
            req.in_flight = True
            items.append(BatchItem(rid, work.key, work.positions, work.depth, work.logits_positions,
                                   work.draft, work.verify))
            used += n
        if not items:
            return None
        return ScheduledBatch(next(self._batch_ids), op, tuple(items))

    def _grow(self, req: SchedRequest, num_tokens: int) -> bool:
        while not self.kv.allocate(req.request_id, num_tokens, req.planes):
            if not self._capacity_preempt(req):
                return False
        return True

    # ------------------------------------------------------------------ introspection
    def stats(self) -> dict:
        count = lambda s: sum(1 for r in self.requests.values() if r.status is s)  # noqa: E731
        return {
            "num_waiting": len(self.waiting),
            "num_running": count(S.ACTIVE),
            "num_receiving": len(self.receiving),
            "num_transferring": len(self.transferring),
            "num_slots": len(self.admission_slots),
            "num_preemptions": self.num_preemptions,
            "pending": {k.value: len(q) for k, q in self.queues.items() if q},
        }

    def assert_invariants(self) -> None:
        c = self.config
        assert len(self.admission_slots) <= c.max_num_seqs, "more slots than max_num_seqs"
        for rid, req in self.requests.items():
            if req.status is S.ACTIVE:
                assert rid in self.admission_slots, f"ACTIVE {rid} holds no slot"
            if req.status is S.WAITING:
                assert rid in self.waiting and rid not in self.pending, f"WAITING {rid} outside the waiting queue"
            if req.status is S.RECEIVING:
                assert rid not in self.admission_slots and rid in self.receiving
            if req.status is S.FINISHED:
                assert req.in_flight, f"FINISHED {rid} not retired though nothing holds it"
            if req.status is S.TRANSFERRING:
                assert rid not in self.admission_slots and rid in self.transferring
            if rid in self.pending:
                work = req.work
                assert work is not None and work.key is self.pending[rid] and req.status is S.ACTIVE
                if work.key in FIXED_OPERATION:
                    assert work.op is FIXED_OPERATION[work.key], f"{rid}: {work.key} bound to {work.op}"
        for rid in self.admission_slots:
            req = self.requests.get(rid)
            assert req is not None and (req.status is S.ACTIVE or (req.status is S.FINISHED and req.in_flight)), \
                f"slot held by {rid} in {getattr(req, 'status', None)}"
        queued = sum(len(q) for q in self.queues.values())
        assert queued == len(self.pending), "queue entries and pending index disagree"
        for key, q in self.queues.items():
            for rid in q:
                assert self.pending.get(rid) is key, f"{rid} queued under {key} but indexed elsewhere"
        self.kv.check()
        if not self.requests:
            assert not self.admission_slots and self.kv.usage().used_blocks == 0, "resources left at drain"
