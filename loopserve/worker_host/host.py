"""EngineHost: an EngineCore on a background step thread, behind a small RPC-shaped surface.

Everything the engine does happens on the thread that calls it, so every engine call (the
step loop's and the RPC threads') holds one lock. The host itself is the colocated worker;
PrefillWorker and DecodeWorker (through TransferHost, which owns their KV connector) add KV
transfer through the `_poll_transfers` / `_after_step` hooks. Methods are the RPC surface a `WorkerHandle` calls (Ray actor methods
or plain-process RPC), so arguments and results are plain picklable values.
"""

from __future__ import annotations

import logging
import os
import threading

from loopserve.engine.config import EngineConfig, given_scheduler_keys, merge_engine_data
from loopserve.engine.engine_core import EngineCore, EngineFailedError
from loopserve.protocol.model_limits import ModelLimits
from loopserve.protocol.outputs import RequestOutput
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.protocol.handoff import HandoffMessage
from loopserve.protocol.prefix_keys import PrefixKeyer
from loopserve.protocol.stats import WorkerStats
from loopserve.kv_cache import CacheEvents
from loopserve.worker_host.engine_lock import EngineLock
from loopserve.protocol.events import WorkerEvents, WorkerLoad
from loopserve.worker_host.records import RecentIds, StatusTraces

log = logging.getLogger(__name__)

IDLE_WAIT_S = 0.05  # nothing to do at all
POLL_WAIT_S = 0.001  # transfers in flight: poll the KV connector this often
# Prefix-cache changes kept for the next poll; past it they fold into one snapshot, so a
# router that stops polling costs memory bounded by the cache.
MAX_CACHE_CHANGES = 1 << 16


class EngineHost:
    role = "colocated"

    def __init__(self, worker_id: str, engine: dict, transfer: dict | None = None) -> None:
        if (role := given_scheduler_keys(engine).get("role", self.role)) != self.role:
            raise ValueError(f"engine.role is {role!r} but this is a {self.role} worker")
        self.worker_id = worker_id
        self.transfer = dict(transfer or {})
        self.engine = EngineCore(EngineConfig(**merge_engine_data(engine, {"role": self.role})))
        self._lock = EngineLock()  # every engine (and KV connector) call
        self._events_cv = threading.Condition()  # the buffers below; taken after _lock, never before
        self._outputs: list[RequestOutput] = []
        self._handoffs: list[HandoffMessage] = []
        self._cache_events: list[CacheEvents] = []
        self._cache_changes = 0
        self.engine.kv_manager.prefix.record_events()
        self.engine.scheduler.record_status_changes()
        self._wake = threading.Event()
        self._accepted = 0
        self.traces = StatusTraces()
        self._aborted_early = RecentIds()
        self._stop = False
        self._setup_transfers()
        self._refresh_load()
        self._thread = threading.Thread(target=self._run, name=f"{worker_id}-step", daemon=True)
        self._thread.start()

    def _setup_transfers(self) -> None:
        """Subclasses create their KV transfer agent here, before the step loop starts."""

    # ------------------------------------------------------------------ step loop
    def _run(self) -> None:
        while not self._stop:
            try:
                with self._lock.step():
                    busy = self._tick()
                    waiting = self._transfers_pending()
                    self._refresh_load()
            except Exception as e:  # noqa: BLE001 - raised outside the engine's step (KV transfers)
                log.exception("%s: step loop failed", self.worker_id)
                with self._lock:  # the worker is broken all the same: end its requests as a step would
                    outputs = self.engine.fail(e)
                    self._observe(outputs)
                    self._publish(outputs)
                    self._refresh_load()
            if self.engine.error is not None:  # its requests have ended; the launcher replaces it
                log.error("%s: %s; reporting unhealthy", self.worker_id, self.engine.error)
                return
            if not busy:
                self._wake.wait(POLL_WAIT_S if waiting else IDLE_WAIT_S)
                self._wake.clear()

    def _tick(self) -> bool:
        """Transfers, one engine step, publish; True if anything happened."""
        moved = self._poll_transfers()
        counters = self.engine.counters.batches
        before = sum(counters.values())
        outputs = self.engine.step() if self.engine.has_unfinished() else []
        ran = sum(counters.values()) != before
        handoffs = self._after_step()
        self._observe(outputs)
        self._take_cache_events()  # before the outputs: a next request is routed knowing them
        self._publish(outputs, handoffs)
        return moved or ran or bool(outputs)

    def _poll_transfers(self) -> bool:
        return False

    def _transfers_pending(self) -> bool:
        return False

    def _after_step(self) -> list:
        return []

    def _publish(self, outputs: list[RequestOutput], handoffs: list = ()) -> None:
        if not (outputs or handoffs):
            return
        with self._events_cv:
            self._outputs.extend(outputs)
            self._handoffs.extend(handoffs)
            self._events_cv.notify_all()

    def _take_cache_events(self) -> None:
        """Move the prefix cache's changes to the events buffer (engine lock held)."""
        prefix = self.engine.kv_manager.prefix
        ev = prefix.take_events()
        if not (ev.changes or ev.reset):
            return
        with self._events_cv:
            if ev.reset:
                self._cache_events, self._cache_changes = [], 0
            self._cache_events.append(ev)
            self._cache_changes += len(ev.changes)
            if self._cache_changes > MAX_CACHE_CHANGES:
                prefix.record_events()
                self._cache_events, self._cache_changes = [], 0
                snapshot = prefix.take_events()
                self._cache_events.append(snapshot)
                self._cache_changes = len(snapshot.changes)

    def _observe(self, outputs: list[RequestOutput] = ()) -> None:
        """Record the scheduler status of each live request whose status was set since the
        last call, and FINISHED as outputs say so. The traces are those a read of every live
        request would give, without that read each step (the others record nothing new)."""
        sched = self.engine.scheduler
        for rid in sched.take_status_changes():
            req = sched.get_request(rid)
            if req is not None and rid in self.engine.requests:
                self.traces.record(rid, req.status.value)
        for out in outputs:
            if out.finished:
                self.traces.record(out.request_id, "FINISHED")

    # ------------------------------------------------------------------ RPC surface
    def submit(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> bool:
        """Queue a request; ValueError names a bad field, QueueFullError when the queue is full.

        False if the request was aborted before it arrived.
        """
        with self._lock:
            if self._aborted_early.pop(request_id):
                return False
            self._check_healthy()
            self.engine.add_request(prompt, params, request_id)
            self._accepted += 1
            self._observe()
            self._refresh_load()
        self._wake.set()
        return True

    def abort(self, request_id: str) -> bool:
        """Abort wherever the request is; True if this worker knew it."""
        with self._lock:
            known = self._abort_locked(request_id)
            if not known:
                self._aborted_early.add(request_id)
        self._wake.set()
        return known

    def _abort_locked(self, request_id: str) -> bool:
        if request_id not in self.engine.requests:
            return False
        self.engine.abort(request_id)
        self.traces.record(request_id, "FINISHED")
        return True

    def get_events(self, timeout: float = 0.5) -> WorkerEvents:
        """Long poll: block up to `timeout` s for news, then return all of it and the load."""
        with self._events_cv:
            if not (self._outputs or self._handoffs):
                self._events_cv.wait(timeout)
            ev = WorkerEvents(self._outputs, self._handoffs, self._cache_events)
            self._outputs, self._handoffs, self._cache_events, self._cache_changes = [], [], [], 0
        ev.load = self.load()
        return ev

    def load(self) -> WorkerLoad:
        """As of the last step or accepted submit: never waits for the engine, so a poll is
        answered during a long step (the router tells a busy worker from a hung one)."""
        return self._load

    def _refresh_load(self) -> None:
        """Snapshot the load (the engine lock is held, or the step loop is not running yet).

        Runs every step: it reads the counts it reports, not the scheduler's stats() or the
        KV manager's usage(), which walk every request and block table."""
        waiting, running = self.engine.scheduler.load()
        pool = self.engine.kv_manager.looped
        extra_queue, extra_blocks = self._unplaced()
        self._load = WorkerLoad(
            worker_id=self.worker_id, role=self.role,
            queue_depth=waiting + extra_queue, running=running,
            free_blocks=pool.num_free - extra_blocks, total_blocks=pool.num_blocks,
            accepted=self._accepted, healthy=self.engine.error is None, error=self.engine.error,
        )

    def _unplaced(self) -> tuple[int, int]:
        """Work accepted but not yet in the scheduler: (requests, looped blocks it will take)."""
        return 0, 0

    def model_limits(self) -> ModelLimits:
        """What this engine accepts of a request, for the router to check requests against."""
        return self.engine.limits

    def prefix_keyer(self) -> PrefixKeyer | None:
        """How this engine keys its prefix cache (None: caching is off), for the router."""
        return self.engine.prefix_keyer

    def stats(self) -> dict:
        """`WorkerStats.to_dict()`: plain data over any launcher (the handle rebuilds it)."""
        with self._lock:
            return self._stats().to_dict()

    def _stats(self) -> WorkerStats:
        """This worker's stats (engine lock held); a role adds its own part."""
        error = self.engine.error
        return WorkerStats(self.worker_id, self.role, healthy=error is None, error=error,
                           accepted=self._accepted, engine=self.engine.stats())

    def health(self) -> dict:
        alive = self._thread.is_alive()
        error = self.engine.error
        return {"worker_id": self.worker_id, "role": self.role, "ok": error is None and alive,
                "pid": os.getpid(), "error": error or (None if alive else "step loop not running")}

    def trace(self, request_id: str) -> list[str]:
        with self._lock:
            return self.traces.get(request_id)

    def check_no_leaks(self) -> dict:
        """Raise unless pool accounting holds and an idle engine holds no blocks; return usage."""
        with self._lock:
            self.engine.check_no_leaks()
            u = self.engine.kv_manager.usage()
            return {"looped": u.looped.__dict__, "flat": u.flat.__dict__,
                    "unfinished": self.engine.has_unfinished()}

    def _check_healthy(self) -> None:
        if self.engine.error is not None:
            raise EngineFailedError(f"worker {self.worker_id} takes no new requests: {self.engine.error}")

    def shutdown(self) -> None:
        """Stop the step loop and release the engine and KV agent; idempotent."""
        if self._stop:
            return
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        with self._lock:
            self.engine.shutdown()
            self._close_transfers()

    def _close_transfers(self) -> None:
        pass
