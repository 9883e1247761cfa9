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
from typing import Any

from loopserve.cluster.worker_spec import worker_class
from loopserve.decode_worker.worker import DecodeWorker
from loopserve.kv_transfer.nixl_agent import NixlKVWorker
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


class DelayedReads:
    """A NIXL agent whose READs are posted `delay_s` after `start_read`; a READ that cannot be
    posted then is reported failed by `poll`. Everything else is the agent's own."""

    def __init__(self, agent: NixlKVWorker, delay_s: float) -> None:
        self._agent = agent
        self._delay_s = delay_s
        self._waiting: dict[str, tuple[float, tuple]] = {}  # request -> (due, start_read args)

    def start_read(self, request_id: str, *args: Any) -> int:
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

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


class SlowReadDecodeWorker(DecodeWorker):
    def _setup_transfers(self) -> None:
        super()._setup_transfers()
        self.nixl = DelayedReads(self.nixl, READ_DELAY_S)


def fault_class(role: str) -> type:
    """The worker class of the fault tests: slow READs on the decode side, else the real one."""
    return SlowReadDecodeWorker if role == "decode" else worker_class(role)
