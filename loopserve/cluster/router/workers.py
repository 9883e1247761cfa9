"""The router's view of one worker: its load (last report plus submits it has not counted
yet), its health (its own report, missed deadlines, failed), and the threads that call it."""

from __future__ import annotations

import math
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor

from loopserve.cluster.handle import WorkerHandle
from loopserve.protocol.events import WorkerLoad
from loopserve.protocol.prefix_keys import PrefixKeyer


class WorkerState:
    """The router's view of one worker: its last reported load plus submits not yet counted,
    whether it answers, and the threads that call it (one slow worker holds only its own)."""

    def __init__(self, handle: WorkerHandle) -> None:
        self.handle = handle
        self.id = handle.worker_id
        self.load: WorkerLoad | None = None
        self.healthy = True  # its engine works (its own report)
        self.failed = False  # its requests were moved off it; serves again once it polls healthy
        self.silent_since: float | None = None  # a call or poll missed its deadline
        self.polling_since: float | None = None  # the pump's long poll in flight
        self.error: str | None = None
        self.sent = 0
        self.pending: deque[tuple[int, int]] = deque()  # (send number, looped blocks)
        self.calls = ThreadPoolExecutor(4, f"to-{self.id}")
        # Observability (stats) on a thread of its own, one call in flight that every caller
        # shares: scrapes of a hung worker never take the threads submits and handoffs need,
        # and never queue behind each other.
        self.observer = ThreadPoolExecutor(1, f"stats-{self.id}")
        self.stats_call: Future | None = None
        self.keyer: PrefixKeyer | None = None  # how its prefix cache keys blocks (None: off)

    @property
    def routable(self) -> bool:
        return self.healthy and not self.failed and self.silent_since is None

    def why_not(self, now: float) -> str | None:
        if self.routable:
            return None
        if self.silent_since is not None and not self.failed:
            return f"unresponsive for {now - self.silent_since:.1f} s"
        return self.error or "unhealthy"

    def poll_late(self, now: float, limit_s: float) -> TimeoutError | None:
        """Its long poll has been out more than `limit_s` (the watchdog marks it unresponsive)."""
        since = self.polling_since
        if since is not None and now - since > limit_s:
            return TimeoutError(f"no event poll answer for {now - since:.1f} s")
        return None

    def silent_too_long(self, now: float, fail_s: float) -> str | None:
        """Unresponsive for more than `fail_s` and not failed yet: why to fail it now."""
        silent = self.silent_since
        if silent is not None and not self.failed and now - silent > fail_s:
            return f"worker {self.id} did not answer for {now - silent:.1f} s"
        return None

    def note_sent(self, blocks: int) -> None:
        self.sent += 1
        self.pending.append((self.sent, blocks))

    def unsend(self) -> None:
        """A submit that was not accepted: the worker's `accepted` will not count it."""
        self.sent -= 1
        if self.pending:
            self.pending.pop()

    def reset(self) -> None:
        """A restarted worker counts its accepted submits from 0 again."""
        self.sent = 0
        self.pending.clear()

    def on_load(self, load: WorkerLoad) -> None:
        self.load = load
        self.healthy = load.healthy
        while self.pending and self.pending[0][0] <= load.accepted:
            self.pending.popleft()

    @property
    def queue_depth(self) -> int:
        reported = self.load.queue_depth + self.load.running if self.load else 0
        return reported + len(self.pending)

    @property
    def free_blocks(self) -> float:
        reported = self.load.free_blocks if self.load else math.inf
        return reported - sum(b for _, b in self.pending)
