"""Immutable scheduled batches (the async tickets) and the results the engine reports back.

BatchItem and ItemResult are NamedTuples: one of each is made per request per step, and a
NamedTuple is immutable at a third of a frozen dataclass's construction cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter
from typing import NamedTuple

from loopserve.kv_cache import BlockTable
from loopserve.scheduler.types import FIXED_OPERATION, Operation, WorkKey


class BatchItem(NamedTuple):
    request_id: str
    work_key: WorkKey  # what this request was selected for
    positions: tuple[int, ...]  # rows (absolute token positions), ascending
    depth: int = 0  # RECURRENT: the loop run now (1-based); else 0
    logits_positions: tuple[int, ...] = ()  # CODA: rows whose logits the engine samples
    draft: bool = False  # SPECULATIVE: a shallow draft phase
    verify: bool = False  # SPECULATIVE: the full-depth verify coda


_request_id, _work_key = attrgetter("request_id"), attrgetter("work_key")


@dataclass(frozen=True)
class ScheduledBatch:
    """One model call: every item runs `operation`; a request appears at most once."""

    batch_id: int
    operation: Operation
    items: tuple[BatchItem, ...]

    def __post_init__(self) -> None:
        if not self.items:
            raise ValueError(f"batch {self.batch_id} has no items")
        if len(set(map(_request_id, self.items))) != len(self.items):
            raise ValueError(f"batch {self.batch_id} selects a request twice")
        for key in set(map(_work_key, self.items)):
            fixed = FIXED_OPERATION.get(key)
            if fixed is not None and fixed is not self.operation:
                raise ValueError(
                    f"batch {self.batch_id} is {self.operation.value} but holds {key.value} work"
                )

    @property
    def num_rows(self) -> int:
        return sum(len(i.positions) for i in self.items)

    @property
    def work_keys(self) -> frozenset[WorkKey]:
        return frozenset(i.work_key for i in self.items)


@dataclass(frozen=True)
class SchedulerOutput:
    batch: ScheduledBatch | None
    swap_out: tuple[tuple[str, BlockTable], ...] = ()  # engine copies these blocks to host first
    swap_in: tuple[tuple[str, BlockTable], ...] = ()  # then back from host into these blocks
    preempted: tuple[str, ...] = ()  # requests that lost their slot this step
    freed: tuple[str, ...] = ()  # requests whose blocks were released since the last step


class ItemResult(NamedTuple):
    exited: tuple[int, ...] = ()  # RECURRENT: positions that made their final exit at this depth
    sampled: tuple[int, ...] = ()  # CODA: tokens produced (decode 1, verify 1..k, draft 1)
    finished: bool = False  # the engine saw a stop condition


@dataclass(frozen=True)
class BatchResult:
    items: dict[str, ItemResult]


@dataclass
class UpdateEvents:
    finished: list[str] = field(default_factory=list)  # finished by this batch (not aborts)
    transferring: list[str] = field(default_factory=list)  # prefill role: KV awaits a reader
