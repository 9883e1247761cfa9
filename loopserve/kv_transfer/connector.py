"""Scheduler-side transfer bookkeeping (pure Python): prefill leases, decode read deadlines."""

from __future__ import annotations


class Deadlines:
    """Request ids with a deadline each; `expired(now)` removes and returns the lapsed ones."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._deadline: dict[str, float] = {}

    def start(self, request_id: str, now: float) -> None:
        self._deadline[request_id] = now + self.timeout_s

    def renew(self, request_ids: list[str], now: float) -> None:
        for rid in request_ids:
            if rid in self._deadline:
                self._deadline[rid] = now + self.timeout_s

    def done(self, request_id: str) -> bool:
        """True if the request was still tracked."""
        return self._deadline.pop(request_id, None) is not None

    def expired(self, now: float) -> list[str]:
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

    A lease only runs out when no reader renews it (the decode side died or dropped the
    request), so blocks are never freed under a live but backlogged reader.
    """

    def __init__(self, lease_s: float = 30.0) -> None:
        super().__init__(lease_s)

    add = Deadlines.start


class ReceiveTracker(Deadlines):
    """Decode side: reads in flight, each with a bounded wait (never waits forever)."""

    def __init__(self, timeout_s: float = 30.0) -> None:
        super().__init__(timeout_s)
