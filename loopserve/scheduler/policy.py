"""Batch selection order for each policy, and the no_refill cohort gate.

A plan is one candidate batch: an Operation and the lanes it is filled from, in order.
Plans are ordered by how long their work has waited: a lane's age is the later of its oldest
entry's ready time and the last time the plan was served, so a plan just served goes behind
every plan that has been waiting (round robin across lanes: decode is never starved by
prompts, nor prompts by decode). Ties go to later stages (CODA, then RECURRENT, then
PRELUDE; decode before prompts) so started work finishes first. The priority policy orders
by the best waiting priority first. Mixed: when both recurrent lanes hold work, the mixed
recurrent batch comes first.
"""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.scheduler.queues import WorkQueues
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


def order_plans(policy: str, queues: WorkQueues, served: dict[Plan, int]) -> list[Plan]:
    """Non-empty plans, best first."""
    lanes = queues.lanes
    by_priority = policy == "priority"
    scored = []
    for plan in MIXED_PLANS if policy == "mixed" else SINGLE_PLANS:
        ready = [lanes[lane] for lane in plan.lanes if len(lanes[lane])]
        if not ready:
            continue
        age = max(min(q.head().ready_tick for q in ready), served.get(plan, -1))
        best = min(q.head_rank() for q in ready) if by_priority else 0
        scored.append(((best, age, plan.stage), plan))
    scored.sort(key=lambda s: s[0])
    plans = [p for _, p in scored]
    if policy == "mixed" and all(len(lanes[lane]) for lane in MIXED_RECURRENT.lanes):
        plans.remove(MIXED_RECURRENT)
        plans.insert(0, MIXED_RECURRENT)
    return plans


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
