"""DecodeWorker: takes over prefilled requests, READs their KV from the prefill worker, decodes.

A handoff waits in the inbox until the engine has blocks for it (RECEIVING), then for the
device to have zeroed them (a fence on the compute stream, polled each tick: the engine keeps
stepping meanwhile), then one KV connector READ pulls every plane of the prompt's blocks; when
it lands the request is activated and decodes from its first token. While a handoff is queued or being read, the worker renews the
prefill side's lease every heartbeat (a `renew` notification), so those blocks are never
freed under a backlogged reader; a handoff it drops unread gets a `release`.

Blocks a READ writes into are freed only once the connector reports the READ finished, even when the
request was aborted or its READ timed out (the caller is told at once; the blocks wait).
Otherwise a late write could land in blocks that already belong to another request.

Handoff latency is measured here, on one clock: from the handoff's arrival at this worker
(`submit_handoff`) to its READ done (the KV in place, the request ready to decode). It covers
the wait for blocks and the READ; the hop from the prefill side is left out because the two
workers' clocks need not agree.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import replace
from typing import TYPE_CHECKING

from loopserve.kv_transfer.leases import ReceiveTracker
from loopserve.protocol.handoff import HandoffMessage
from loopserve.protocol.outputs import RequestOutput
from loopserve.protocol.stats import DecodeStats, WorkerStats
from loopserve.worker_host.transfer_host import TransferHost

if TYPE_CHECKING:
    from loopserve.engine.model_runner import KVFence
    from loopserve.kv_cache import BlockTable

log = logging.getLogger(__name__)
# Upper bounds (seconds) of the handoff-latency histogram; stats() carries them, so the front
# renders the histogram without knowing them.
HANDOFF_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class DecodeWorker(TransferHost):
    role = "decode"

    def _setup_transfers(self) -> None:
        super()._setup_transfers()
        self.tracker = ReceiveTracker(timeout_s=self.transfer.get("read_timeout_s", 30.0))
        self.heartbeat_s = self.transfer.get("heartbeat_s", 1.0)
        self._inbox: deque[HandoffMessage] = deque()  # waiting for blocks
        self._arrived: dict[str, float] = {}  # queued handoff -> when it arrived
        # placed, its READ waiting for the zeroing of its blocks: (msg, blocks, fence, placed at)
        self._fencing: dict[str, tuple[HandoffMessage, BlockTable, KVFence, float]] = {}
        # READ in flight: (msg, READ start, bytes, arrival)
        self._reading: dict[str, tuple[HandoffMessage, float, int, float]] = {}
        self._dropped: set[str] = set()  # aborted or timed out while their READ is in flight
        self._next_heartbeat = 0.0
        self._peers: dict[str, str] = {}  # prefill engine id -> its connector agent name
        # seconds: READs posted to seen done; fence_seconds: from blocks given to the device
        # having zeroed them (and run what it had queued before), when the READ is posted
        self.reads = {"count": 0, "failed": 0, "bytes": 0, "seconds": 0.0, "fence_seconds": 0.0}
        self.handoff_latency = {"le": list(HANDOFF_BUCKETS), "counts": [0] * len(HANDOFF_BUCKETS),
                                "count": 0, "sum": 0.0}  # counts[i]: latencies <= le[i]

    def add_peer(self, info: dict) -> None:
        """Handshake with a prefill worker. Repeating it is a no-op (several routers may start
        over the same workers); a restarted peer (new agent) replaces the old one."""
        with self._lock:
            if self._peers.get(info["engine_id"]) == info["agent_name"]:
                return
            self.connector.add_peer(info)
            self._peers[info["engine_id"]] = info["agent_name"]

    def submit_handoff(self, message: HandoffMessage) -> bool:
        """Queue a prefilled request; False if it was aborted before it arrived."""
        with self._lock:
            if self._aborted_early.pop(message.request_id):
                self._release(message)
                return False
            self._check_healthy()
            self._inbox.append(message)
            self._arrived[message.request_id] = time.monotonic()
            self._accepted += 1
            self._refresh_load()
        self._wake.set()
        return True

    # ------------------------------------------------------------------ transfers
    def _poll_transfers(self) -> bool:
        now = time.monotonic()
        placed = self._place_inbox(now)
        placed += self._post_fenced()
        done, failed = self.connector.poll()
        for rid in done:
            self._read_finished(rid, None)
        for rid in failed:
            self._read_finished(rid, "KV read failed")
        for rid in self.tracker.expired(now):
            self._read_timed_out(rid)
        self._heartbeat(now)
        if not self.connector.progress_thread:
            self.connector.progress()  # flush the renew/release notes just queued
        return bool(placed or done or failed)

    def _place_inbox(self, now: float) -> int:
        """Give queued handoffs blocks, in arrival order; their READs wait for the fence."""
        placed = 0
        while self._inbox:
            msg = self._inbox[0]
            try:
                got = self.engine.place_handoff(msg)
            except ValueError as e:  # a duplicate id or an impossible request: fail it alone
                self._inbox.popleft()
                self._arrived.pop(msg.request_id, None)
                self._release(msg)
                self._publish([RequestOutput.ended(msg.request_id, "error", str(e))])
                continue
            if got is None:  # no blocks yet: retried next tick, the lease renewed meanwhile
                break
            self._inbox.popleft()
            self.traces.record(msg.request_id, "RECEIVING")
            self._fencing[msg.request_id] = (msg, *got, now)
            placed += 1
        return placed

    def _post_fenced(self) -> int:
        """Post the READs whose blocks the device has zeroed."""
        ready = [rid for rid, (_, _, fence, _) in self._fencing.items() if fence.done()]
        for rid in ready:
            msg, table, _, placed = self._fencing.pop(rid)
            posted = time.monotonic()
            self.reads["fence_seconds"] += posted - placed
            self._start_read(msg, table, posted)
        return len(ready)

    def _start_read(self, msg: HandoffMessage, table, now: float) -> bool:
        """Post the READ; `now` is the post time (the READ's clock starts there)."""
        rid = msg.request_id
        arrived = self._arrived.pop(rid, now)
        try:
            nbytes = self.connector.start_read(rid, msg.prefill_engine_id, msg.block_table, table,
                                          msg.num_kv_tokens, self.engine.cached_blocks(rid))
        except Exception as e:  # noqa: BLE001 - unknown peer, bad table: this request fails
            self._release(msg)
            self.engine.kv_failed(rid, f"KV read could not start: {e}")
            self.traces.record(rid, "FINISHED")
            return False
        self.tracker.start(rid, now)
        self._reading[rid] = (msg, now, nbytes, arrived)
        return True

    def _read_finished(self, request_id: str, error: str | None) -> None:
        entry = self._reading.pop(request_id, None)
        if entry is None:
            return
        msg, t0, nbytes, arrived = entry
        self.tracker.done(request_id)
        if request_id in self._dropped:  # the caller already has its final output
            self._dropped.discard(request_id)
            self.engine.abort(request_id)
            return
        if error is None:
            self.reads["count"] += 1
            self.reads["bytes"] += nbytes
            now = time.monotonic()
            self.reads["seconds"] += now - t0
            self._observe_handoff(now - arrived)
            self.engine.kv_received(request_id)
            return
        self.reads["failed"] += 1
        log.warning("%s: %s: %s", self.worker_id, request_id, error)
        self._release(msg)
        self.engine.kv_failed(request_id, error)
        self.traces.record(request_id, "FINISHED")

    def _observe_handoff(self, seconds: float) -> None:
        h = self.handoff_latency
        h["count"] += 1
        h["sum"] += seconds
        for i, le in enumerate(h["le"]):
            if seconds <= le:
                h["counts"][i] += 1

    def _read_timed_out(self, request_id: str) -> None:
        """Fail the request now; its blocks stay reserved until the connector reports the READ over."""
        msg = self._reading[request_id][0]
        self.reads["failed"] += 1
        self._dropped.add(request_id)
        self._release(msg)
        error = f"KV read did not finish within {self.tracker.timeout_s} s"
        log.warning("%s: %s: %s", self.worker_id, request_id, error)
        self._publish([RequestOutput.ended(request_id, "error", error, "UNAVAILABLE")])
        self.traces.record(request_id, "FINISHED")

    def _release(self, msg: HandoffMessage) -> None:
        """Tell the prefill side it may free a handoff this worker will not read (best effort:
        if the note is lost, the unrenewed lease frees it)."""
        self.connector.notify(msg.prefill_engine_id, "release", [msg.request_id])

    def _heartbeat(self, now: float) -> None:
        if now < self._next_heartbeat or not self._transfers_pending():
            return
        self._next_heartbeat = now + self.heartbeat_s
        renew: dict[str, list[str]] = {}
        waiting = [*self._inbox, *(entry[0] for entry in (*self._fencing.values(), *self._reading.values()))]
        for msg in waiting:
            if msg.request_id not in self._dropped:
                renew.setdefault(msg.prefill_engine_id, []).append(msg.request_id)
        for peer, ids in renew.items():
            self.connector.notify(peer, "renew", ids)

    def _transfers_pending(self) -> bool:
        return bool(self._inbox or self._fencing or self._reading)

    def _unplaced(self) -> tuple[int, int]:
        return len(self._inbox), sum(m.looped_blocks() for m in self._inbox)

    def _abort_locked(self, request_id: str) -> bool:
        if request_id in self._fencing:  # no READ posted: its blocks free with the request
            self._release(self._fencing.pop(request_id)[0])
            return super()._abort_locked(request_id)
        if request_id in self._reading:
            if request_id not in self._dropped:
                self._dropped.add(request_id)
                self._release(self._reading[request_id][0])
                self.traces.record(request_id, "FINISHED")
            return True
        for msg in self._inbox:
            if msg.request_id == request_id:
                self._inbox.remove(msg)
                self._arrived.pop(request_id, None)
                self._release(msg)
                self.traces.record(request_id, "FINISHED")
                return True
        return super()._abort_locked(request_id)

    def _stats(self) -> WorkerStats:
        return replace(super()._stats(), decode=DecodeStats.from_dict(
            {"kv_reads": self.reads, "handoff_latency": self.handoff_latency,
             "inbox": len(self._inbox), "reading": len(self._fencing) + len(self._reading)}))
