"""What a worker's long poll returns: everything new since the last poll, plus its load.

One pump per worker reads these (not one poll per request), so a batch carries the outputs
and handoffs of every request the worker serves, and what its prefix cache stored and dropped
(the router's index of who holds which prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from loopserve.kv_cache import CacheEvents
from loopserve.protocol.handoff import HandoffMessage
from loopserve.protocol.outputs import RequestOutput


@dataclass(frozen=True)
class WorkerLoad:
    """What the router balances on; `accepted` lets it tell which of its submits are counted."""

    worker_id: str
    role: str
    queue_depth: int  # waiting in the scheduler (+ handoffs not yet admitted, decode side)
    running: int  # holding an admission slot
    free_blocks: int  # looped pool, minus what admitted-but-unplaced handoffs will take
    total_blocks: int
    accepted: int  # submit / submit_handoff calls accepted so far
    healthy: bool = True
    error: str | None = None


@dataclass
class WorkerEvents:
    outputs: list[RequestOutput] = field(default_factory=list)
    handoffs: list[HandoffMessage] = field(default_factory=list)  # prefill side
    cache: list[CacheEvents] = field(default_factory=list)  # prefix-cache changes, in order
    load: WorkerLoad | None = None
