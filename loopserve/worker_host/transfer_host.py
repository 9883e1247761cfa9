"""TransferHost: an EngineHost whose KV pools are registered with a KV connector.

Prefill and decode workers both move KV between engines; the connector's creation (before
the step loop starts, of the kind `transfer.connector` names) and its release (at shutdown)
are the same for both, so they live here.
"""

from __future__ import annotations

import torch

from loopserve.engine.engine_core import EngineCore
from loopserve.kv_transfer.connector import KVConnector
from loopserve.kv_transfer.registry import DEFAULT_CONNECTOR, make_connector
from loopserve.worker_host.host import EngineHost


def kv_pools(engine: EngineCore) -> dict[str, torch.Tensor]:
    """The engine's block-major KV tensors, by pool name, for the connector to register."""
    kv = engine.runner.kv
    return {"looped": kv.looped, **({"flat": kv.flat} if kv.flat is not None else {})}


class TransferHost(EngineHost):
    """Subclasses extend `_setup_transfers` (calling super first) with their role's bookkeeping."""

    connector: KVConnector

    def _setup_transfers(self) -> None:
        self.connector = make_connector(self.transfer.get("connector", DEFAULT_CONNECTOR), self.worker_id,
                                        kv_pools(self.engine), self.engine.layout.block_size,
                                        self.engine.kv_compat(),
                                        progress_thread=self.transfer.get("progress_thread", False))

    def _close_transfers(self) -> None:
        self.connector.close()
