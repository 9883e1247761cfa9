"""Scheduler-side transfer bookkeeping (pure Python): prefill leases, decode read deadlines.

Time is passed in (`now`, any monotonic clock), so the logic is exact and testable.
"""

from __future__ import annotations


class Deadlines:
    """Request ids with a deadline each; `expired(now)` removes and returns the lapsed ones."""

    def __init__(self, timeout_s: float) -> None:
        if not timeout_s > 0:
            raise ValueError(f"{type(self).__name__} timeout must be > 0 seconds, got {timeout_s}")
        self.timeout_s = timeout_s
        self._deadline: dict[str, float] = {}

    def start(self, request_id: str, now: float) -> None:
        if request_id in self._deadline:
            raise ValueError(f"request {request_id!r} is already tracked by {type(self).__name__}")
        self._deadline[request_id] = now + self.timeout_s

    def done(self, request_id: str) -> bool:
        """True if the request was still tracked (it is not any more)."""
        return self._deadline.pop(request_id, None) is not None

    def deadline(self, request_id: str) -> float:
        return self._deadline[request_id]

    def expired(self, now: float) -> list[str]:
        """Ids whose deadline is <= now, in start order; they are no longer tracked."""
        gone = [rid for rid, t in self._deadline.items() if t <= now]
        for rid in gone:
            del self._deadline[rid]
        return gone

    def pending(self) -> list[str]:
        return list(self._deadline)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._deadline

    def __len__(self) -> int:
        return len(self._deadline)


class TransferLedger(Deadlines):
    """Prefill side: TRANSFERRING requests, each with a lease the reader renews by heartbeat.

    A lease only runs out `lease_s` after its last renewal, so blocks are never freed under a
    live but backlogged reader (vLLM frees on a fixed timeout counted from the handoff); they
    are freed when the reader is gone (died, or dropped the request without saying so).
    """

    def __init__(self, lease_s: float = 30.0) -> None:
        super().__init__(lease_s)

    def add(self, request_id: str, now: float) -> None:
        self.start(request_id, now)

    def renew(self, request_ids: list[str], now: float) -> list[str]:
        """Extend the leases of `request_ids`; returns those not held (already freed or unknown)."""
        missing = []
        for rid in request_ids:
            if rid in self._deadline:
                self._deadline[rid] = now + self.timeout_s
            else:
                missing.append(rid)
        return missing


class ReceiveTracker(Deadlines):
    """Decode side: READs in flight, each with a bounded wait after which it counts as failed."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        super().__init__(timeout_s)
