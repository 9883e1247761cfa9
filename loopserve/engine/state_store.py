"""Carried loop state of rows between Operations, on the model's device.

A request has at most a prompt chunk or a speculation round of rows in flight; each row's
`LoopState` row lives here from its PRELUDE until its CODA consumed it. All rows share one
slab (a free list of slab rows), so a batch's state moves with one gather and one scatter
whatever the number of requests in it: per-request tensors cost two small kernels and a
host-to-device index copy per request per Operation, which dominated large decode batches.
"""

from __future__ import annotations

import torch

from loopserve.model.batch import device_tensor


class StateStore:
    def __init__(self, width: int, dtype: torch.dtype, device: torch.device, capacity: int = 256) -> None:
        self.width, self.dtype, self.device = width, dtype, device
        self.hidden = torch.empty(capacity, width, dtype=dtype, device=device)
        self.aux = torch.empty(capacity, dtype=torch.float32, device=device)
        self._free = list(range(capacity - 1, -1, -1))
        self._rows: dict[str, dict[int, int]] = {}  # request -> position -> slab row

    @property
    def capacity(self) -> int:
        return self.hidden.shape[0]

    def _grow(self, need: int) -> None:
        old = self.capacity
        new = max(2 * old, old + need)
        self.hidden = torch.cat([self.hidden, self.hidden.new_empty(new - old, self.width)])
        self.aux = torch.cat([self.aux, self.aux.new_empty(new - old)])
        self._free[:0] = range(new - 1, old - 1, -1)  # popped from the end: low rows first

    def rows(self, items: list[tuple[str, list[int]]], assign: bool = False) -> torch.Tensor:
        """Slab rows (device index) of every (request, positions) in order; `assign` gives
        positions that have none a fresh row (a PRELUDE's new rows)."""
        out: list[int] = []
        for rid, positions in items:
            mine = self._rows.setdefault(rid, {}) if assign else self._rows[rid]
            if assign:
                fresh = [p for p in positions if p not in mine] if mine else list(positions)
                if len(fresh) > len(self._free):
                    self._grow(len(fresh) - len(self._free))
                for p in fresh:
                    mine[p] = self._free.pop()
            out += map(mine.__getitem__, positions)
        return device_tensor(out, torch.int64, self.device)

    def get(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hidden.index_select(0, rows), self.aux.index_select(0, rows)

    def put(self, rows: torch.Tensor, hidden: torch.Tensor, aux: torch.Tensor) -> None:
        self.hidden.index_copy_(0, rows, hidden.to(self.dtype))
        self.aux.index_copy_(0, rows, aux.float())

    def drop(self, request_id: str) -> None:
        self._free += self._rows.pop(request_id, {}).values()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    @property
    def rows_in_use(self) -> int:
        return self.capacity - len(self._free)
