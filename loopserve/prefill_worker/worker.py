"""PrefillWorker: runs prompts to their first token, then holds the KV until a decode worker
has READ it.

A finished prompt becomes a handoff (published with the first token's output) and gets a
lease. The decode side speaks to it only through KV connector notifications: `read` (the READ is
done) and `release` (it will not read after all) free the blocks, `renew` (heartbeats while
the handoff waits or is being read) extends the lease. A lease runs out only when no reader
renews it any more (it died or lost the request). Aborting a TRANSFERRING request frees at
once: the router aborts its reader too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from loopserve.kv_transfer.leases import TransferLedger
from loopserve.protocol.stats import PrefillStats, WorkerStats
from loopserve.worker_host.transfer_host import TransferHost

log = logging.getLogger(__name__)


class PrefillWorker(TransferHost):
    role = "prefill"

    def _setup_transfers(self) -> None:
        super()._setup_transfers()
        self.ledger = TransferLedger(lease_s=self.transfer.get("lease_s", 30.0))
        self.leases_expired = 0

    def handshake_info(self) -> dict:
        with self._lock:
            return self.connector.handshake_info()

    def _after_step(self) -> list:
        now = time.monotonic()
        msgs = self.engine.take_handoffs()
        for m in msgs:
            m.prefill_engine_id = self.worker_id
            self.ledger.add(m.request_id, now)
        return msgs

    def _poll_transfers(self) -> bool:
        now = time.monotonic()
        notes = self.connector.poll_notifications()
        self.ledger.renew(notes["renew"], now)
        freed = [rid for rid in notes["read"] + notes["release"] if self.ledger.done(rid)]
        expired = self.ledger.expired(now)
        for rid in expired:
            log.warning("%s: lease of %s expired unread; freeing its blocks", self.worker_id, rid)
        self.leases_expired += len(expired)
        for rid in freed + expired:
            self.engine.transfer_done(rid)
            self.traces.record(rid, "FINISHED")
        return bool(freed or expired)

    def _stats(self) -> WorkerStats:
        return replace(super()._stats(), prefill=PrefillStats(len(self.ledger), self.leases_expired))

    def _transfers_pending(self) -> bool:
        return len(self.ledger) > 0

    def _abort_locked(self, request_id: str) -> bool:
        self.ledger.done(request_id)
        with self._events_cv:  # a handoff not yet fetched must not reach a decode worker
            self._handoffs = [m for m in self._handoffs if m.request_id != request_id]
        return super()._abort_locked(request_id)
