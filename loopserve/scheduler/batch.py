"""Immutable scheduled batches (async tickets) and the results the engine reports back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from loopserve.kv_cache import BlockTable
from loopserve.scheduler.types import Operation, WorkKey


class BatchItem(NamedTuple):  # immutable and cheap: one per request per step
    request_id: str
    work_key: WorkKey  # what this request was selected for
    positions: tuple[int, ...]
    depth: int = 0  # RECURRENT: the loop run now (1-based)
    logits_positions: tuple[int, ...] = ()  # CODA: rows whose logits are sampled
    draft: bool = False  # SPECULATIVE draft phase
    verify: bool = False  # SPECULATIVE verify coda


@dataclass(frozen=True)
class ScheduledBatch:
    batch_id: int
    operation: Operation
    items: tuple[BatchItem, ...]

    @property
    def num_rows(self) -> int:
        return sum(len(i.positions) for i in self.items)


@dataclass(frozen=True)
class SchedulerOutput:
    batch: ScheduledBatch | None
    swap_out: tuple[tuple[str, BlockTable], ...] = ()  # copy to host before the batch
    swap_in: tuple[tuple[str, BlockTable], ...] = ()  # copy back from host before the batch
    preempted: tuple[str, ...] = ()


class ItemResult(NamedTuple):
    exited: tuple[int, ...] = ()
    sampled: tuple[int, ...] = ()
    finished: bool = False


@dataclass(frozen=True)
class BatchResult:
    items: dict[str, ItemResult]


@dataclass
class UpdateEvents:
    finished: list[str] = field(default_factory=list)
    transferring: list[str] = field(default_factory=list)


class QueueFullError(RuntimeError):
    """Backpressure: the waiting queue is at max_waiting."""
