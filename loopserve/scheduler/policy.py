"""Scheduling policies: one class each behind `Policy`, found by name in `POLICIES`.

A policy answers what the scheduler asks: a request's rank (waiting queue, lanes,
preemption victims; lower first), whether admission may preempt lower-ranked requests, the
cohort gate if it has one, and the order in which candidate batches (plans) are tried. A new
policy is one class registered here (SchedulerConfig validates names against `POLICIES`).

A plan is one candidate batch: an Operation and the lanes it is filled from, in order. Plans
belong to groups. The plans of one request cycle whose rows can meet in one batch form a group
(decode: its PRELUDE, RECURRENT and CODA; speculation likewise; every mixed plan); each
prompt lane is a group of its own. Order, after ranks (under the priority policy the best
waiting priority; every other policy ranks all requests 0):

* Across groups, round robin by age: a group's age is the later of its oldest entry's ready
  time and the last time one of its plans was served, oldest first, so a group just served
  goes behind every group that has been waiting (decode is never starved by prompts, nor
  prompts by decode). Ties: decode, then speculation, then prompt lanes by stage.
* Within a group, the widest plan (most ready requests; a CODA plan counts 1/CODA_HOLD of
  them) first: a group of requests out of phase waits while the larger one comes round to its
  Operation, and then both run in one batch, so groups converge. A plan whose oldest entry
  has been passed over `max_wait_steps` schedule steps is overdue and goes before every plan
  of its group that is not, oldest first: the starvation bound (docs/scheduler.md states it).
  Ties: later stages first (CODA, RECURRENT, PRELUDE).

Mixed: when both recurrent lanes hold work and no plan is overdue, the mixed recurrent batch
comes first.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

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
    group: int  # plans of one group share its round-robin turn and compete by width


_STAGE_ORDER: tuple[Lane, ...] = (
    (K.DECODE_CODA, C_), (K.SPECULATIVE, C_), (K.PROMPT_ATOMIC, C_),
    (K.DECODE_RECURRENT, R_), (K.SPECULATIVE, R_), (K.PROMPT_RECURRENT, R_), (K.PROMPT_ATOMIC, R_),
    (K.DECODE_PRELUDE, P_), (K.SPECULATIVE, P_), (K.PROMPT_PRELUDE, P_), (K.PROMPT_ATOMIC, P_),
)
# A CODA batch goes ahead of a plan of its group only when it is this many times as wide: a
# CODA pass costs two steps (the CODA, then the PRELUDE of the same rows), so it waits while
# the rows still looping are a fair share, and those that exit meanwhile join the same pass.
CODA_HOLD = 4

# One group per WorkKey cycle whose rows meet in batches (a group's id: its first stage, so
# ties between groups go to decode, then speculation, then prompt lanes by stage).
_GROUP: dict[WorkKey, int] = {K.DECODE_CODA: 0, K.DECODE_RECURRENT: 0, K.DECODE_PRELUDE: 0,
                              K.SPECULATIVE: 1}
SINGLE_PLANS = tuple(Plan(lane[1], (lane,), i, _GROUP.get(lane[0], i)) for i, lane in enumerate(_STAGE_ORDER))
MIXED_RECURRENT = Plan(R_, ((K.DECODE_RECURRENT, R_), (K.PROMPT_RECURRENT, R_)), 1, 0)
MIXED_PLANS = (
    Plan(C_, ((K.DECODE_CODA, C_),), 0, 0),
    MIXED_RECURRENT,
    Plan(P_, ((K.DECODE_PRELUDE, P_), (K.PROMPT_PRELUDE, P_)), 2, 0),
)


class Scored(NamedTuple):
    """A non-empty plan and what orders it."""

    plan: Plan
    rank: Hashable  # best head rank of its lanes
    oldest: int  # ready tick of its oldest head
    within: tuple  # order inside its group: (0, ready step, stage) overdue, else (1, -width, stage)


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

    def order_plans(self, queues: WorkQueues, served: dict[Plan, int], step: int,
                    max_wait: int) -> list[Plan]:
        """Non-empty plans, best first (`served`: the tick each plan was last served; `step`:
        the current schedule step; `max_wait`: steps after which a plan is overdue)."""
        return [s.plan for s in self._scored(queues, served, step, max_wait)]

    def _scored(self, queues: WorkQueues, served: dict[Plan, int], step: int,
                max_wait: int) -> list[Scored]:
        lanes = queues.lanes
        scored: list[Scored] = []
        turn: dict[int, int] = {}  # group -> the tick one of its plans was last served
        for plan in self.plans:
            g = plan.group
            last = served.get(plan, -1)
            if last > turn.get(g, -1):
                turn[g] = last
            ready = [lanes[lane] for lane in plan.lanes if len(lanes[lane])]
            if not ready:
                continue
            heads = [q.head() for q in ready]
            oldest = min(h.ready_tick for h in heads)
            waiting_since = min(h.ready_step for h in heads)
            overdue = step - waiting_since >= max_wait
            width = sum(map(len, ready)) * (1 if plan.operation is C_ else CODA_HOLD)
            within = (0, waiting_since, plan.stage) if overdue else (1, -width, plan.stage)
            scored.append(Scored(plan, min(q.head_rank() for q in ready), oldest, within))
        first_ready: dict[int, int] = {}
        for s in scored:
            g = s.plan.group
            first_ready[g] = min(first_ready.get(g, s.oldest), s.oldest)

        def key(s: Scored) -> tuple:
            g = s.plan.group
            last = turn.get(g, -1)
            # age: its oldest entry's ready tick, or its last turn if later; equal ages: the
            # group served longer ago first
            return (s.rank, max(first_ready[g], last), last, g, s.within)

        scored.sort(key=key)
        return scored


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

    def order_plans(self, queues: WorkQueues, served: dict[Plan, int], step: int,
                    max_wait: int) -> list[Plan]:
        scored = self._scored(queues, served, step, max_wait)
        plans = [s.plan for s in scored]
        if (all(len(queues.lanes[lane]) for lane in MIXED_RECURRENT.lanes)
                and not any(s.within[0] == 0 for s in scored)):
            plans.remove(MIXED_RECURRENT)
            plans.insert(0, MIXED_RECURRENT)
        return plans
