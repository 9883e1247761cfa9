"""Per-request work state machine: which item a request runs next and how a result advances it.

No queues, slots or KV here. A request carries one unit of rows at a time (the whole prompt,
a prefill chunk, a decode token or a speculation round) through PRELUDE -> RECURRENT at
depth 1.. (rows that made their final exit drop out) -> CODA. `plan` is pure, so an item
that cannot be scheduled (budget, KV) leaves the request untouched; AFTER[operation]
applies a retired item's result.
"""

from __future__ import annotations

from enum import Enum

from loopserve.scheduler.batch import BatchItem, ItemResult
from loopserve.scheduler.config import SchedulerConfig
from loopserve.scheduler.request import RequestState, Unit
from loopserve.scheduler.types import Operation, WorkKey

P_, R_, C_ = Operation.PRELUDE, Operation.RECURRENT, Operation.CODA

WORK_KEY: dict[Unit, dict[Operation, WorkKey]] = {
    Unit.ATOMIC: {P_: WorkKey.PROMPT_ATOMIC, R_: WorkKey.PROMPT_ATOMIC, C_: WorkKey.PROMPT_ATOMIC},
    Unit.CHUNK: {P_: WorkKey.PROMPT_PRELUDE, R_: WorkKey.PROMPT_RECURRENT, C_: WorkKey.DECODE_CODA},
    Unit.DECODE: {P_: WorkKey.DECODE_PRELUDE, R_: WorkKey.DECODE_RECURRENT, C_: WorkKey.DECODE_CODA},
    Unit.SPEC: {P_: WorkKey.SPECULATIVE, R_: WorkKey.SPECULATIVE, C_: WorkKey.SPECULATIVE},
}


class Outcome(Enum):
    CONTINUE = "continue"  # more work: queue the request's next item
    FINISHED = "finished"
    TRANSFER = "transfer"  # prefill role: prompt done, first token sampled, KV awaits a reader


def spec_round_size(st: RequestState, cfg: SchedulerConfig) -> int:
    """Draft tokens for a round starting now; < 2 means the plain decode cycle.

    Capped so the round's positions never pass prompt_len + max_tokens - 2 (emitting more
    than max_tokens). Needs greedy sampling and draft_loops below the request's max_loops,
    otherwise the draft would be the full-depth model.
    """
    spec, req = cfg.speculative, st.request
    if spec is None or not req.greedy or spec.draft_loops >= req.max_loops:
        return 0
    return min(spec.num_draft_tokens, req.max_tokens - st.n_out)


def begin_unit(st: RequestState, cfg: SchedulerConfig) -> None:
    """Start the request's next unit (the prompt is unfinished, or a token was produced)."""
    st.phase, st.depth, st.live, st.rows = P_, 0, (), ()
    if st.done < st.request.prompt_len:
        st.unit = Unit.CHUNK if cfg.split_prefill else Unit.ATOMIC
        return
    k = spec_round_size(st, cfg) if cfg.speculative is not None else 0
    if k >= 2:
        st.unit, st.spec_k, st.spec_j, st.spec_deep, st.verify = Unit.SPEC, k, 0, (), False
    else:
        st.unit = Unit.DECODE


def prelude_rows(st: RequestState, cfg: SchedulerConfig, budget: int) -> tuple[int, ...]:
    """Rows of the unit's next PRELUDE; a chunk shrinks to the batch's remaining budget."""
    unit, done = st.unit, st.done
    if unit is Unit.DECODE:
        return (done,)  # (plan() inlines this common case)
    if unit is Unit.SPEC:
        return (done + st.spec_j,)
    end = st.request.prompt_len
    if unit is Unit.CHUNK:
        end = min(end, done + cfg.prefill_chunk_size, done + max(budget, 1))
    return tuple(range(done, end))


def plan(st: RequestState, cfg: SchedulerConfig, budget: int) -> BatchItem:
    """The item for the request's pending work (pure)."""
    rid, unit, phase = st.request_id, st.unit, st.phase
    key = WORK_KEY[unit][phase]
    draft = unit is Unit.SPEC and not st.verify
    if phase is R_:
        return BatchItem(rid, key, st.live, st.depth + 1, (), draft)
    if phase is P_:
        rows = (st.done,) if unit is Unit.DECODE else prelude_rows(st, cfg, budget)
        return BatchItem(rid, key, rows, 0, (), draft)
    if unit is Unit.DECODE:
        pos = (st.done,)
        return BatchItem(rid, key, pos, 0, pos)
    if unit is Unit.SPEC:
        if st.verify:
            pos = tuple(range(st.done, st.done + st.spec_k))
            return BatchItem(rid, key, pos, 0, pos, False, True)
        pos = (st.done + st.spec_j,)
        return BatchItem(rid, key, pos, 0, pos, True)
    last = st.request.prompt_len - 1
    logits = (last,) if st.rows[-1] == last else ()
    return BatchItem(rid, key, st.rows if cfg.coda_writes_kv else (last,), 0, logits)


def check_result(st: RequestState, item: BatchItem, op: Operation, res: ItemResult) -> None:
    """Reject results that contradict the item (an engine bug), before anything changes."""
    rid = st.request_id
    if op is R_ and res.exited:
        if not set(res.exited) <= set(item.positions):
            raise ValueError(f"{rid}: exited {res.exited} not among the item's rows {item.positions}")
        if item.depth < st.request.min_loops:
            raise ValueError(
                f"{rid}: rows exited at depth {item.depth} < min_loops {st.request.min_loops}"
            )
    elif op is C_ and item.logits_positions and not res.finished:
        n, most = len(res.sampled), len(item.logits_positions) if item.verify else 1
        if not 1 <= n <= most:
            raise ValueError(f"{rid}: CODA sampled {n} tokens, expected 1..{most}")


def after_prelude(st: RequestState, item: BatchItem, res: ItemResult, cfg: SchedulerConfig,
                  batch_id: int) -> Outcome:
    st.live, st.depth, st.phase, st.cohort = item.positions, 0, R_, batch_id
    if st.unit is not Unit.SPEC:
        st.rows = item.positions
    return Outcome.CONTINUE


def after_loop(st: RequestState, item: BatchItem, res: ItemResult, cfg: SchedulerConfig,
               batch_id: int) -> Outcome:
    d = item.depth
    st.depth = d
    if d >= st.request.max_loops:
        live: tuple[int, ...] = ()  # every row exits at max_loops
    elif res.exited:
        gone = set(res.exited)
        live = tuple(p for p in item.positions if p not in gone)
    else:
        live = item.positions
    unit = st.unit
    if unit is Unit.SPEC and not st.verify and live and d >= cfg.speculative.draft_loops:
        st.spec_deep += live  # stopped at draft depth without a final exit: verify goes deeper
        live = ()
    st.live = live
    if live:
        return Outcome.CONTINUE
    if unit is Unit.CHUNK and not cfg.coda_writes_kv and st.rows[-1] != st.request.prompt_len - 1:
        st.done = st.rows[-1] + 1  # no coda KV to write and no logits wanted: chunk complete
        begin_unit(st, cfg)
        return Outcome.CONTINUE
    st.phase = C_
    return Outcome.CONTINUE


def after_coda(st: RequestState, item: BatchItem, res: ItemResult, cfg: SchedulerConfig,
               batch_id: int) -> Outcome:
    unit = st.unit
    if unit is Unit.SPEC and not st.verify:
        st.spec_j += 1
        if st.spec_j < st.spec_k:
            st.phase = P_
        else:
            st.verify, st.live, st.depth = True, st.spec_deep, cfg.speculative.draft_loops
            st.phase = R_ if st.live else C_
        return Outcome.CONTINUE
    if unit is Unit.ATOMIC or unit is Unit.CHUNK:
        st.done = st.rows[-1] + 1
        if not st.prompt_done:
            begin_unit(st, cfg)
            return Outcome.CONTINUE
        st.n_out += len(res.sampled)
    else:  # a decode token, or a verified speculation round
        n = len(res.sampled)
        st.done += n
        st.n_out += n
    if st.n_out >= st.request.max_tokens:
        return Outcome.FINISHED
    if cfg.role == "prefill":
        return Outcome.TRANSFER
    begin_unit(st, cfg)
    return Outcome.CONTINUE


# How a retired item of each Operation advances its request (the caller handles `finished`).
AFTER = {P_: after_prelude, R_: after_loop, C_: after_coda}
