"""The scheduler's view of a request: lengths, loop bounds, lifecycle and pending work."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from loopserve.scheduler.types import Operation, RequestStatus, WorkKey


class Work(NamedTuple):
    """One pending work item: what the next batch holding this request will run."""

    key: WorkKey
    op: Operation
    positions: tuple[int, ...]
    depth: int = 0
    logits_positions: tuple[int, ...] = ()
    draft: bool = False
    verify: bool = False


@dataclass
class SpecRound:
    start: int  # position of the last accepted token (its prelude starts the round)
    k: int  # positions in the round: start .. start + k - 1
    drafted: int = 0  # draft codas done
    unfinished: list[int] = field(default_factory=list)  # rows stopped at draft depth, not exited


@dataclass
class SchedRequest:
    request_id: str
    prompt_len: int
    max_tokens: int
    min_loops: int
    max_loops: int
    priority: int = 0  # lower = more important
    arrival_time: float = 0.0
    greedy: bool = True
    num_planes: int | None = None  # KV planes for looped layers (default: max_loops)
    # --- runtime state (owned by the scheduler)
    status: RequestStatus = RequestStatus.WAITING
    num_output: int = 0
    prefilled: int = 0  # prompt positions whose chunks are done
    work: Work | None = None
    in_flight: bool = False
    aborted: bool = False
    kv_ready: bool = False  # decode role: KV landed
    snapshot: Work | None = None  # pending work saved at first suspension
    offloaded: bool = False  # KV on host, blocks freed
    offload_tokens: int = 0
    spec: SpecRound | None = None
    seq: int = 0  # arrival order, the FIFO tiebreak

    @property
    def planes(self) -> int:
        return self.num_planes or self.max_loops

    @property
    def total_tokens(self) -> int:
        return self.prompt_len + self.max_tokens

    @property
    def next_decode_position(self) -> int:
        return self.prompt_len + self.num_output - 1
