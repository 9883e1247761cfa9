"""A worker in the test process: a real colocated EngineHost behind a direct-call handle.

The cheapest real worker for server-side tests (no Ray actor, no process, no NIXL): the
engine, its validation and its errors are the real ones, only the transport is a call.
"""

from __future__ import annotations

from typing import Any

from loopserve.cluster.handle import WorkerHandle
from loopserve.prefill_worker.host import EngineHost


class InProcessHandle(WorkerHandle):
    def __init__(self, worker_id: str, engine: dict) -> None:
        super().__init__(worker_id, "colocated")
        self.host = EngineHost(worker_id, engine)

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return getattr(self.host, method)(*args)

    def kill(self) -> None:
        self.host.shutdown()
