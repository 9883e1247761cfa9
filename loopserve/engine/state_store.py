"""Carried loop state of rows between Operations, per request, on the model's device.

A request has at most a prompt chunk or a speculation round of rows in flight; each row's
`LoopState` row lives here from its PRELUDE until its CODA consumed it.
"""

from __future__ import annotations

import torch


class _RequestRows:
    def __init__(self, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.index: dict[int, int] = {}  # position -> buffer row
        self.hidden = torch.empty(0, width, dtype=dtype, device=device)
        self.aux = torch.empty(0, dtype=torch.float32, device=device)

    def rows(self, positions: list[int]) -> list[int]:
        return [self.index[p] for p in positions]

    def assign(self, positions: list[int]) -> list[int]:
        """Buffer rows for `positions`, reusing rows of positions written before."""
        fresh = [p for p in positions if p not in self.index]
        if fresh:
            start = self.hidden.shape[0]
            self.hidden = torch.cat([self.hidden, self.hidden.new_empty(len(fresh), self.hidden.shape[1])])
            self.aux = torch.cat([self.aux, self.aux.new_empty(len(fresh))])
            for i, p in enumerate(fresh):
                self.index[p] = start + i
        return self.rows(positions)


class StateStore:
    def __init__(self, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.width, self.dtype, self.device = width, dtype, device
        self._reqs: dict[str, _RequestRows] = {}

    def put(self, request_id: str, positions: list[int], hidden: torch.Tensor, aux: torch.Tensor) -> None:
        r = self._reqs.get(request_id)
        if r is None:
            r = self._reqs[request_id] = _RequestRows(self.width, self.dtype, self.device)
        idx = torch.tensor(r.assign(positions), device=self.device)
        r.hidden.index_copy_(0, idx, hidden.to(self.dtype))
        r.aux.index_copy_(0, idx, aux.float())

    def get(self, request_id: str, positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        r = self._reqs[request_id]
        idx = torch.tensor(r.rows(positions), device=self.device)
        return r.hidden.index_select(0, idx), r.aux.index_select(0, idx)

    def drop(self, request_id: str) -> None:
        self._reqs.pop(request_id, None)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._reqs
