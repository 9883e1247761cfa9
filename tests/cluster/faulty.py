"""Test-side fault injection: an engine step that raises, as a faulting CUDA kernel would, and
KV READs that are slow to start.

loopserve has no switch for either. Tests break a live engine's runner from here, in this
process (`break_engine(host)`) or inside a Ray actor of `FaultyHost`, a colocated worker with
one more method; `SlowReadDecodeWorker` posts every READ `READ_DELAY_S` after the worker
starts it, so requests stay RECEIVING (decode) / TRANSFERRING (prefill) for a known time.
`fault_class` is what a launcher's `worker_class` becomes for those workers (Ray imports this
module in the actor's process, which has the checkout on its path).
"""

from __future__ import annotations

import time

from loopserve.cluster.worker_spec import worker_class
from loopserve.decode_worker.worker import DecodeWorker
from loopserve.kv_cache import BlockTable
from loopserve.kv_transfer.connector import KVConnector
from loopserve.worker_host.host import EngineHost

READ_DELAY_S = 1.0

FAULT = "injected device fault"


def break_engine(host: EngineHost, after_tokens: int = 0) -> None:
    """From now on, a RECURRENT batch of the host's engine raises once a request in it has
    `after_tokens` output tokens (0: the next one raises)."""
    real = host.engine.runner.recurrent

    def broken(batch, reqs, *args, **kwargs):
        if any(len(r.output_token_ids) >= after_tokens for r in reqs.values()):
            raise RuntimeError(FAULT)
        return real(batch, reqs, *args, **kwargs)

    host.engine.runner.recurrent = broken


class FaultyHost(EngineHost):
    def break_engine(self) -> None:
        break_engine(self)


class DelayedReads(KVConnector):
    """A KV connector whose READs are posted `delay_s` after `start_read`; a READ that cannot
    be posted then is reported failed by `poll`. Everything else is the wrapped connector's."""

    def __init__(self, agent: KVConnector, delay_s: float) -> None:
        self._agent = agent
        self._delay_s = delay_s
        self._waiting: dict[str, tuple[float, tuple]] = {}  # request -> (due, start_read args)
        self.engine_id, self.progress_thread = agent.engine_id, agent.progress_thread

    def handshake_info(self) -> dict:
        return self._agent.handshake_info()

    def add_peer(self, info: dict) -> None:
        self._agent.add_peer(info)

    def start_read(self, request_id: str, peer_engine_id: str, remote_table: BlockTable | dict,
                   local_table: BlockTable | dict, num_tokens: int, first_block: int = 0) -> int:
        args = (peer_engine_id, remote_table, local_table, num_tokens, first_block)
        self._waiting[request_id] = (time.monotonic() + self._delay_s, args)
        return 0  # bytes are not known before the READ is posted

    def poll(self) -> tuple[list[str], list[str]]:
        now, unposted = time.monotonic(), []
        for rid in [r for r, (due, _) in self._waiting.items() if due <= now]:
            try:
                self._agent.start_read(rid, *self._waiting.pop(rid)[1])
            except Exception:  # noqa: BLE001 - e.g. the peer died meanwhile: the READ fails
                unposted.append(rid)
        done, failed = self._agent.poll()
        return done, failed + unposted

    def notify(self, peer_engine_id: str, kind: str, request_ids: list[str]) -> bool:
        return self._agent.notify(peer_engine_id, kind, request_ids)

    def poll_notifications(self) -> dict[str, list[str]]:
        return self._agent.poll_notifications()

    def progress(self) -> None:
        self._agent.progress()

    def close(self) -> None:
        self._agent.close()


class SlowReadDecodeWorker(DecodeWorker):
    def _setup_transfers(self) -> None:
        super()._setup_transfers()
        self.connector = DelayedReads(self.connector, READ_DELAY_S)


def fault_class(role: str) -> type:
    """The worker class of the fault tests: slow READs on the decode side, else the real one."""
    return SlowReadDecodeWorker if role == "decode" else worker_class(role)
