"""Bounded per-request bookkeeping a long-running worker keeps: status traces and tombstones."""

from __future__ import annotations

from collections import OrderedDict


class StatusTraces:
    """The distinct lifecycle statuses each request went through, in order (for tests and ops).

    Only changes are recorded; FINISHED is terminal (a request the caller already has a final
    output for may still hold blocks a moment, e.g. under a late READ). The oldest requests
    are forgotten beyond `limit`.
    """

    def __init__(self, limit: int = 4096) -> None:
        self.limit = limit
        self._traces: OrderedDict[str, list[str]] = OrderedDict()

    def record(self, request_id: str, status: str) -> None:
        trace = self._traces.get(request_id)
        if trace is None:
            trace = self._traces[request_id] = []
            while len(self._traces) > self.limit:
                self._traces.popitem(last=False)
        if not trace or trace[-1] not in (status, "FINISHED"):
            trace.append(status)

    def get(self, request_id: str) -> list[str]:
        return list(self._traces.get(request_id, ()))


class RecentIds:
    """Ids aborted before the worker saw them, so a late submit of that id is dropped.

    An abort and the submit it races with travel on different connections; without this a
    cancelled request could start after its abort and run unobserved.
    """

    def __init__(self, limit: int = 16384) -> None:
        self.limit = limit
        self._ids: OrderedDict[str, None] = OrderedDict()

    def add(self, request_id: str) -> None:
        self._ids[request_id] = None
        while len(self._ids) > self.limit:
            self._ids.popitem(last=False)

    def pop(self, request_id: str) -> bool:
        """True (and forgotten) if the id was aborted before it arrived."""
        return self._ids.pop(request_id, 0) is None
