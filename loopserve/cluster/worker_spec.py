"""WorkerSpec: one worker to launch (role, engine config, resources), whatever the launcher."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field

START_TIMEOUT_S = 300.0  # model load + NIXL agent creation, on a busy machine

_CLASSES = {
    "colocated": "loopserve.worker_host.host:EngineHost",
    "prefill": "loopserve.prefill_worker.worker:PrefillWorker",
    "decode": "loopserve.decode_worker.worker:DecodeWorker",
}


def worker_class(role: str) -> type:
    if role not in _CLASSES:
        raise ValueError(f"role must be one of {sorted(_CLASSES)}, got {role!r}")
    module, name = _CLASSES[role].split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    role: str
    engine: dict  # EngineConfig fields (role filled in by the worker)
    transfer: dict = field(default_factory=dict)  # TransferConfig fields
    num_cpus: float = 1.0
    num_gpus: float = 0.0
    env: dict = field(default_factory=dict)  # environment of the worker process

    def kwargs(self) -> dict:
        return {"worker_id": self.worker_id, "engine": self.engine, "transfer": self.transfer}
