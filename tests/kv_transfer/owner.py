"""The prefill side of the NIXL tests, run in its own (spawned) process: it owns KV pools filled
from a seed, answers the handshake and reports the notifications it receives.

Commands over the pipe: ("notes", count, max_idle_polls) -> notifications once `count` ids
arrived (or after that many polls in a row brought nothing: a bound by progress, not time); ("restart", seed) -> a new agent under the same engine id, new data, its
handshake info; ("stop",).
"""

from __future__ import annotations

import time

import torch

from loopserve.kv_transfer.connector import NOTIFY_KINDS
from loopserve.kv_transfer.nixl_agent import NixlKVWorker

BLOCK_SIZE = 16
SHAPES = {"looped": (96, 4, 2, BLOCK_SIZE, 2, 64), "flat": (32, 2, 2, BLOCK_SIZE, 2, 64)}
DTYPE = torch.bfloat16
COMPAT = {"model": "tiny-huginn", "max_loops": 3}


def make_pools(seed: int, device: str = "cpu", shapes: dict = SHAPES, dtype: torch.dtype = DTYPE) -> dict:
    """Deterministic pool contents, so the reader can rebuild what the owner holds."""
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(s, generator=g).to(dtype).to(device) for k, s in shapes.items()}


def serve(conn, engine_id: str, seed: int, device: str = "cpu") -> None:
    worker = NixlKVWorker(engine_id, make_pools(seed, device), BLOCK_SIZE, COMPAT)
    conn.send(worker.handshake_info())
    while True:
        cmd, *args = conn.recv()
        if cmd == "notes":
            count, max_idle_polls = args
            notes = {k: [] for k in NOTIFY_KINDS}
            idle = 0
            while sum(map(len, notes.values())) < count and idle < max_idle_polls:
                got = worker.poll_notifications()
                for k, ids in got.items():
                    notes[k] += ids
                idle = 0 if any(got.values()) else idle + 1
                time.sleep(0.002)
            conn.send(notes)
        elif cmd == "restart":
            worker.close()
            worker = NixlKVWorker(engine_id, make_pools(args[0], device), BLOCK_SIZE, COMPAT)
            conn.send(worker.handshake_info())
        else:
            worker.close()
            conn.send("stopped")
            return
