"""WorkerHandle: how the router and server talk to a worker, wherever it runs.

Two implementations (Ray actor, plain process) provide `_call`; every method is a blocking
call that re-raises the worker's own exception (ValueError for bad input, QueueFullError,
...), so callers never see launcher-specific error types for worker-side failures. A call
given a `timeout` raises TimeoutError when the worker has not answered by then (the router
bounds every call but the event long-poll, which it watches itself).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from loopserve.protocol.events import WorkerEvents
from loopserve.protocol.handoff import HandoffMessage
from loopserve.protocol.model_limits import ModelLimits
from loopserve.protocol.prefix_keys import PrefixKeyer
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.protocol.stats import WorkerStats


class WorkerHandle(ABC):
    def __init__(self, worker_id: str, role: str) -> None:
        self.worker_id = worker_id
        self.role = role

    @abstractmethod
    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        """Run `method(*args)` on the worker and return its result (or raise its exception)."""

    @abstractmethod
    def kill(self) -> None:
        """Stop the worker's process/actor without asking it (after shutdown, or if it hangs)."""

    def wait_ready(self, timeout: float) -> dict:
        return self._call("health", timeout=timeout)

    def handshake_info(self) -> dict:
        return self._call("handshake_info")

    def add_peer(self, info: dict) -> None:
        self._call("add_peer", info)

    def model_limits(self) -> ModelLimits:
        return self._call("model_limits")

    def prefix_keyer(self) -> PrefixKeyer | None:
        return self._call("prefix_keyer")

    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams,
               timeout: float | None = None) -> bool:
        return self._call("submit", request_id, prompt, params, timeout=timeout)

    def submit_handoff(self, message: HandoffMessage, timeout: float | None = None) -> bool:
        return self._call("submit_handoff", message, timeout=timeout)

    def get_events(self, poll_s: float) -> WorkerEvents:
        """Long poll; unbounded here: a call given up on would lose the events it drains."""
        return self._call("get_events", poll_s)

    def abort(self, request_id: str, timeout: float = 10.0) -> bool:
        return self._call("abort", request_id, timeout=timeout)  # bounded: the worker may hang

    def stats(self, timeout: float | None = None) -> WorkerStats:
        return WorkerStats.from_dict(self._call("stats", timeout=timeout))

    def health(self, timeout: float | None = None) -> dict:
        return self._call("health", timeout=timeout)

    def trace(self, request_id: str) -> list[str]:
        return self._call("trace", request_id)

    def check_no_leaks(self) -> dict:
        return self._call("check_no_leaks")

    def shutdown(self, timeout: float = 30) -> None:
        """Ask the worker to stop cleanly, then make sure it is gone."""
        try:
            self._call("shutdown", timeout=timeout)
        finally:
            self.kill()

    def restart(self) -> None:
        """Replace a worker that reported itself failed (its engine is dead) or hangs. Here:
        stop it for good, so the router keeps it out; a launcher that can start it again
        overrides."""
        self.shutdown()

    def revive(self) -> None:
        """The worker stopped answering its connection (it died): start it again if the
        launcher does not do so itself. Here: nothing."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.worker_id!r}, role={self.role!r})"
