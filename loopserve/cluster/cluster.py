"""Cluster: the workers of a ClusterConfig, launched, handshaken and behind one Router."""

from __future__ import annotations

import logging
import time

from loopserve.cluster.config import ClusterConfig
from loopserve.cluster.handle import WorkerHandle
from loopserve.cluster.placement import launch, stop_all
from loopserve.cluster.router.core import Router

log = logging.getLogger(__name__)


class Cluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.handles: list[WorkerHandle] = []
        self.router: Router | None = None
        self._ray_head = None  # the private Ray head this cluster started, if any

    def start(self) -> Cluster:
        if self.config.launcher == "ray":
            from loopserve.cluster.ray_launcher import ensure_ray

            self._ray_head = ensure_ray(self.config.ray)
        try:
            self.handles = launch(self.config)
            entry = [h for h in self.handles if h.role in ("prefill", "colocated")]
            decode = [h for h in self.handles if h.role == "decode"]
            server = self.config.server
            self.router = Router(entry, decode, poll_s=server.poll_s,
                                 max_migrations=server.max_migrations,
                                 deadline_s=server.worker_deadline_s,
                                 fail_s=server.worker_fail_s,
                                 policy=server.routing.build(),
                                 local_prefill_tokens=server.local_prefill_tokens).start()
        except BaseException:
            self.stop()
            raise
        log.info("cluster up: %s", ", ".join(h.worker_id for h in self.handles))
        return self

    def stop(self) -> None:
        if self.router is not None:
            self.router.close()
            self.router = None
        stop_all(self.handles)
        self.handles = []
        if self._ray_head is not None:
            self._ray_head.stop()
            self._ray_head = None

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def wait_idle(handles: list[WorkerHandle], timeout: float = 30.0) -> dict[str, dict]:
    """Wait until no worker has unfinished work, then check every pool is back to empty.

    Prefill workers free a request's blocks only when the reader's notification arrives, a
    moment after the request's last token reached the caller, hence the wait.
    """
    deadline = time.monotonic() + timeout
    while True:
        usage = {h.worker_id: h.check_no_leaks() for h in handles}
        if not any(u["unfinished"] for u in usage.values()):
            return usage
        if time.monotonic() > deadline:
            busy = sorted(w for w, u in usage.items() if u["unfinished"])
            raise TimeoutError(f"workers {busy} still have unfinished requests after {timeout} s")
        time.sleep(0.05)
