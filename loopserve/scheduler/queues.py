"""Queues: FIFO within a rank, and the pending-work index (at most one WorkKey per request)."""

from __future__ import annotations

import bisect
from collections.abc import Hashable, Iterator

from loopserve.scheduler.errors import DuplicateSelectionError
from loopserve.scheduler.request import RequestState
from loopserve.scheduler.types import Operation, WorkKey

P_, R_, C_ = Operation.PRELUDE, Operation.RECURRENT, Operation.CODA

# Every (WorkKey, Operation) pair a pending item can have: one lane each.
LANES: tuple[tuple[WorkKey, Operation], ...] = (
    (WorkKey.PROMPT_ATOMIC, P_), (WorkKey.PROMPT_ATOMIC, R_), (WorkKey.PROMPT_ATOMIC, C_),
    (WorkKey.PROMPT_PRELUDE, P_), (WorkKey.PROMPT_RECURRENT, R_),
    (WorkKey.DECODE_PRELUDE, P_), (WorkKey.DECODE_RECURRENT, R_), (WorkKey.DECODE_CODA, C_),
    (WorkKey.SPECULATIVE, P_), (WorkKey.SPECULATIVE, R_), (WorkKey.SPECULATIVE, C_),
)


class RankedFifo:
    """Requests in (rank, insertion) order with O(1) add and remove.

    One insertion-ordered dict per rank; ranks are few (priority levels), kept sorted.
    """

    __slots__ = ("_buckets", "_ranks", "_len")

    def __init__(self) -> None:
        self._buckets: dict[Hashable, dict[str, RequestState]] = {}
        self._ranks: list = []
        self._len = 0

    def add(self, st: RequestState, rank: Hashable) -> None:
        bucket = self._buckets.get(rank)
        if bucket is None:
            bucket = self._buckets[rank] = {}
            bisect.insort(self._ranks, rank)
        bucket[st.request_id] = st
        self._len += 1

    def remove(self, request_id: str, rank: Hashable) -> None:
        bucket = self._buckets[rank]
        del bucket[request_id]
        self._len -= 1
        if not bucket:
            del self._buckets[rank]
            self._ranks.remove(rank)

    def clear(self) -> None:
        self._buckets.clear()
        self._ranks.clear()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[RequestState]:
        for r in self._ranks:
            yield from self._buckets[r].values()

    def snapshot(self) -> list[RequestState]:
        """The entries in order, safe to walk while the queue changes."""
        if len(self._ranks) == 1:
            return list(self._buckets[self._ranks[0]].values())
        return list(self)

    def head(self) -> RequestState:
        return next(iter(self._buckets[self._ranks[0]].values()))

    def head_rank(self) -> Hashable:
        return self._ranks[0]


class WorkQueues:
    """The `pending` index request_id -> WorkKey, and one RankedFifo lane per (WorkKey, Operation).

    A request's lane is (index[rid], st.phase); `phase` never changes while it is pending.
    """

    def __init__(self) -> None:
        self.pending: dict[str, WorkKey] = {}
        self.lanes: dict[tuple[WorkKey, Operation], RankedFifo] = {lane: RankedFifo() for lane in LANES}

    def push(self, sts: list[RequestState], keys: list[WorkKey]) -> None:
        """Queue each request under its key (lane = (key, st.phase)); one call per batch."""
        pending, lanes = self.pending, self.lanes
        for st, key in zip(sts, keys):
            rid = st.request_id
            held = pending.get(rid)
            if held is not None:
                raise DuplicateSelectionError(
                    f"{rid} already has pending work {held.value}; refusing to queue {key.value}"
                )
            pending[rid] = key
            lanes[key, st.phase].add(st, st.rank)

    def take(self, st: RequestState) -> WorkKey:
        """Remove one request's pending entry (preemption or abort)."""
        rid = st.request_id
        key = self.pending.pop(rid, None)
        if key is None:
            raise DuplicateSelectionError(f"{rid} has no pending work to remove")
        self.lanes[key, st.phase].remove(rid, st.rank)
        return key

    def select(self, lane: tuple[WorkKey, Operation], sts: list[RequestState]) -> None:
        """Remove the entries a batch selected from `lane` (all of it, often, in O(1))."""
        queue, pending, key = self.lanes[lane], self.pending, lane[0]
        for st in sts:
            if pending.get(st.request_id) is not key:
                raise DuplicateSelectionError(f"{st.request_id} selected without pending {key.value} work")
        for st in sts:
            del pending[st.request_id]
        if len(sts) == len(queue):
            queue.clear()
        else:
            for st in sts:
                queue.remove(st.request_id, st.rank)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.pending

    def __len__(self) -> int:
        return len(self.pending)
