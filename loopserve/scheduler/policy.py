"""Scheduling policies: one class each behind `Policy`, found by name in `POLICIES`.

A policy answers what the scheduler asks: a request's rank (waiting queue, lanes,
preemption victims; lower first), whether admission may preempt lower-ranked requests, the
cohort gate if it has one, and the order in which candidate batches (plans) are tried. A new
policy is one class registered here (SchedulerConfig validates names against `POLICIES`).

A plan is one candidate batch: an Operation and the lanes it is filled from, in order.
Plans are ordered by how long their work has waited: a lane's age is the later of its oldest
entry's ready time and the last time the plan was served, so a plan just served goes behind
every plan that has been waiting (round robin across lanes: decode is never starved by
prompts, nor prompts by decode). Ties go to later stages (CODA, then RECURRENT, then
PRELUDE; decode before prompts) so started work finishes first. Ranks come first: under the
priority policy the best waiting priority (every other policy ranks all requests 0). Mixed:
when both recurrent lanes hold work, the mixed recurrent batch comes first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from loopserve.scheduler.queues import WorkQueues
from loopserve.scheduler.request import SchedRequest
from loopserve.scheduler.types import Operation, WorkKey

K, P_, R_, C_ = WorkKey, Operation.PRELUDE, Operation.RECURRENT, Operation.CODA
Lane = tuple[WorkKey, Operation]


@dataclass(frozen=True)
class Plan:
    operation: Operation
    lanes: tuple[Lane, ...]  # filled in this order (decode lanes first in mixed plans)
    stage: int  # tiebreak: lower first


_STAGE_ORDER: tuple[Lane, ...] = (
    (K.DECODE_CODA, C_), (K.SPECULATIVE, C_), (K.PROMPT_ATOMIC, C_),
    (K.DECODE_RECURRENT, R_), (K.SPECULATIVE, R_), (K.PROMPT_RECURRENT, R_), (K.PROMPT_ATOMIC, R_),
    (K.DECODE_PRELUDE, P_), (K.SPECULATIVE, P_), (K.PROMPT_PRELUDE, P_), (K.PROMPT_ATOMIC, P_),
)
SINGLE_PLANS = tuple(Plan(lane[1], (lane,), i) for i, lane in enumerate(_STAGE_ORDER))
MIXED_RECURRENT = Plan(R_, ((K.DECODE_RECURRENT, R_), (K.PROMPT_RECURRENT, R_)), 1)
MIXED_PLANS = (
    Plan(C_, ((K.DECODE_CODA, C_),), 0),
    MIXED_RECURRENT,
    Plan(P_, ((K.DECODE_PRELUDE, P_), (K.PROMPT_PRELUDE, P_)), 2),
)


class CohortGate:
    """no_refill: a RECURRENT batch of a WorkKey takes only that key's oldest live cohort.

    A cohort is the rows whose unit began in one PRELUDE batch; it is live while any member
    is queued for or running a loop. Newly prepared tokens wait until it has fully exited.
    """

    def __init__(self) -> None:
        self._live: dict[WorkKey, dict[int, int]] = {}

    def enter(self, key: WorkKey, cohort: int) -> None:
        counts = self._live.setdefault(key, {})
        counts[cohort] = counts.get(cohort, 0) + 1

    def leave(self, key: WorkKey, cohort: int) -> None:
        counts = self._live[key]
        n = counts[cohort] - 1
        if n:
            counts[cohort] = n
        else:
            del counts[cohort]

    def oldest(self, key: WorkKey) -> int | None:
        counts = self._live.get(key)
        return min(counts) if counts else None

    def num_live(self) -> int:
        return sum(sum(c.values()) for c in self._live.values())


class Policy:
    """Defaults (refill's); each policy overrides what differs."""

    name: ClassVar[str]
    plans: ClassVar[tuple[Plan, ...]] = SINGLE_PLANS
    preempts: ClassVar[bool] = False  # admission may preempt lower-ranked requests
    needs_split_prefill: ClassVar[bool] = False
    supports_speculation: ClassVar[bool] = True

    def rank(self, request: SchedRequest) -> int:
        return 0

    def cohort_gate(self) -> CohortGate | None:
        """The gate a RECURRENT batch's rows must pass, kept by the scheduler; None: no gate."""
        return None

    def order_plans(self, queues: WorkQueues, served: dict[Plan, int]) -> list[Plan]:
        """Non-empty plans, best first."""
        lanes = queues.lanes
        scored = []
        for plan in self.plans:
            ready = [lanes[lane] for lane in plan.lanes if len(lanes[lane])]
            if not ready:
                continue
            age = max(min(q.head().ready_tick for q in ready), served.get(plan, -1))
            scored.append(((min(q.head_rank() for q in ready), age, plan.stage), plan))
        scored.sort(key=lambda s: s[0])
        return [p for _, p in scored]


POLICIES: dict[str, type[Policy]] = {}


def register(cls: type[Policy]) -> type[Policy]:
    """Make `cls` selectable by its name (SchedulerConfig.policy)."""
    POLICIES[cls.name] = cls
    return cls


@register
class Refill(Policy):
    """New tokens join RECURRENT batches beside rows at any depth."""

    name = "refill"


@register
class NoRefill(Policy):
    """A RECURRENT batch takes one cohort (rows that began together) until it has exited."""

    name = "no_refill"

    def cohort_gate(self) -> CohortGate:
        return CohortGate()


@register
class Priority(Policy):
    """Lower `priority` values first, everywhere; admission preempts lower-priority requests."""

    name = "priority"
    preempts = True

    def rank(self, request: SchedRequest) -> int:
        return request.priority


@register
class Mixed(Policy):
    """Decode and prompt-chunk rows share batches (needs split prefill; no speculation)."""

    name = "mixed"
    plans = MIXED_PLANS
    needs_split_prefill = True
    supports_speculation = False

    def order_plans(self, queues: WorkQueues, served: dict[Plan, int]) -> list[Plan]:
        plans = super().order_plans(queues, served)
        if all(len(queues.lanes[lane]) for lane in MIXED_RECURRENT.lanes):
            plans.remove(MIXED_RECURRENT)
            plans.insert(0, MIXED_RECURRENT)
        return plans
