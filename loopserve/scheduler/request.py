"""A request as the scheduler sees it: lengths and loop bounds in, lifecycle and progress kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from loopserve.scheduler.types import Operation, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedRequest:
    """What the engine tells the scheduler; no tokens. Lower priority value = more important."""

    request_id: str
    prompt_len: int
    max_tokens: int
    min_loops: int
    max_loops: int
    priority: int = 0
    arrival_time: float = 0.0
    greedy: bool = True
    num_planes: int | None = None  # looped-layer KV planes; None = max_loops (one per depth)
    # prefix-cache keys of the prompt's full blocks (kv_cache/prefix_cache.py); None: not cached
    block_hashes: tuple[bytes, ...] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        for name, low in (("prompt_len", 1), ("max_tokens", 1), ("min_loops", 1)):
            v = getattr(self, name)
            if not isinstance(v, int) or v < low:
                raise ValueError(f"{self.request_id}: {name} must be an integer >= {low}, got {v!r}")
        if not isinstance(self.max_loops, int) or self.max_loops < self.min_loops:
            raise ValueError(
                f"{self.request_id}: max_loops ({self.max_loops!r}) must be an integer >= "
                f"min_loops ({self.min_loops})"
            )
        if not isinstance(self.priority, int):
            raise ValueError(f"{self.request_id}: priority must be an integer, got {self.priority!r}")
        if self.num_planes is not None and (not isinstance(self.num_planes, int)
                                            or not 1 <= self.num_planes <= self.max_loops):
            raise ValueError(
                f"{self.request_id}: num_planes must be in [1, max_loops ({self.max_loops})], "
                f"got {self.num_planes!r}"
            )

    @property
    def planes(self) -> int:
        """KV planes to allocate: one per depth, or fewer (e.g. Dory's last_loop KV: one)."""
        return self.num_planes if self.num_planes is not None else self.max_loops


class Unit(str, Enum):
    """The rows a request is carrying through PRELUDE -> RECURRENT* -> CODA right now."""

    ATOMIC = "atomic"  # the whole prompt (PROMPT_ATOMIC)
    CHUNK = "chunk"  # one prefill chunk (PROMPT_PRELUDE, PROMPT_RECURRENT, DECODE_CODA)
    DECODE = "decode"  # one decode token
    SPEC = "spec"  # one self-speculation round (SPECULATIVE)


@dataclass(slots=True, eq=False)
class RequestState:
    """Mutable per-request state. Progress fields describe the current unit; the pending
    WorkKey is a pure function of (unit, phase), so a suspended request resumes exactly
    where it stopped and re-suspending it cannot lose or retake anything."""

    request: SchedRequest
    seq: int  # arrival order: FIFO tiebreak and the capacity-victim order
    rank: int  # queue rank: the priority under the priority policy, else 0
    status: RequestStatus = RequestStatus.WAITING
    # progress
    done: int = 0  # positions whose KV is complete (every plane, coda included)
    n_out: int = 0  # output tokens produced
    unit: Unit | None = None
    phase: Operation = Operation.PRELUDE  # the Operation of the pending work
    rows: tuple[int, ...] = ()  # the unit's positions (prompt units)
    live: tuple[int, ...] = ()  # rows still looping
    depth: int = 0  # last loop run by the live rows
    cohort: int = 0  # batch id of the unit's last PRELUDE (no_refill)
    spec_k: int = 0  # positions in the speculation round: done .. done + spec_k - 1
    spec_j: int = 0  # draft tokens done in the round
    spec_deep: tuple[int, ...] = ()  # round rows that stopped at draft depth, to verify deeper
    verify: bool = False
    # scheduling
    ready_tick: int = 0  # when its pending work became ready (round robin across groups)
    ready_step: int = 0  # the schedule step it first competes in (the wait bound within a group)
    in_flight: int = 0  # batch id holding it; 0 = none
    offloaded_tokens: int = 0  # > 0: KV is on the host, covering this many positions
    cached_blocks: int = 0  # leading prompt blocks in the prefix cache (hit or indexed by it)
    kv_landed: bool = False  # decode role: the KV read finished
    num_preemptions: int = 0
    request_id: str = field(init=False)  # copied out of `request`: read on every hot path

    def __post_init__(self) -> None:
        self.request_id = self.request.request_id

    @property
    def prompt_done(self) -> bool:
        return self.done >= self.request.prompt_len
