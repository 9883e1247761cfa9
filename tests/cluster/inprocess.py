"""A worker in the test process: a real EngineHost (colocated, or a PD worker with its NIXL
agent) behind a direct-call handle.

The cheapest real worker for server-side tests (no Ray actor, no process): the engine, its
validation and its errors are the real ones, only the transport is a call.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from loopserve.cluster.handle import WorkerHandle
from loopserve.cluster.worker_spec import worker_class


class InProcessHandle(WorkerHandle):
    def __init__(self, worker_id: str, engine: dict, role: str = "colocated",
                 transfer: dict | None = None, classes: Callable[[str], type] = worker_class) -> None:
        super().__init__(worker_id, role)
        self.host = classes(role)(worker_id, engine, transfer)

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return getattr(self.host, method)(*args)

    def kill(self) -> None:
        self.host.shutdown()
