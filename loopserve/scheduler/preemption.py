"""Choosing preemption victims: a dry run first, so nobody is preempted for nothing.

Victims are ranked strictly below the request they make room for, and the ranking is a
total order (priority, then arrival), so the top-ranked live request is never a victim and
always makes progress: no eviction ping-pong, no livelock.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from loopserve.scheduler.request import RequestState
from loopserve.scheduler.types import RequestStatus


@dataclass
class VictimPlan:
    slot: RequestState | None = None  # yields its admission slot
    offload: list[RequestState] = field(default_factory=list)  # KV to host, blocks freed


def plan_victims(
    candidates: Iterable[RequestState],  # eligible, worse-ranked than the requester, worst first
    blocks_of: Callable[[RequestState], tuple[int, int]],  # resident (looped, flat) blocks
    need_slot: bool,
    short: tuple[int, int],  # (looped, flat) blocks missing now
    slot_victim_offloads: bool,  # preemption_mode == "offload"
) -> VictimPlan | None:
    """Victims taken worst first until a slot (if needed) is free and `short` is covered;
    None when even all candidates would not be enough (then nobody is preempted)."""
    plan = VictimPlan()
    looped, flat = short
    if not need_slot and looped <= 0 and flat <= 0:
        return plan
    for st in candidates:
        takes_slot = need_slot and plan.slot is None and st.status is RequestStatus.ACTIVE
        if takes_slot:
            plan.slot = st
        b_looped, b_flat = blocks_of(st)
        if (takes_slot and slot_victim_offloads) or (looped > 0 and b_looped) or (flat > 0 and b_flat):
            plan.offload.append(st)
            looped, flat = looped - b_looped, flat - b_flat
        if (plan.slot is not None or not need_slot) and looped <= 0 and flat <= 0:
            return plan
    return None
