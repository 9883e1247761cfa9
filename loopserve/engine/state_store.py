"""Carried loop state of rows between Operations, on the model's device.

A request has at most a prompt chunk or a speculation round of rows in flight; each row's
`LoopState` row lives here from its PRELUDE until its CODA consumed it. All rows share one
slab (a free list of slab rows), so a batch's state moves with one gather and one scatter
whatever the number of requests in it: per-request tensors cost two small kernels and a
host-to-device index copy per request per Operation, which dominated large decode batches.

A row can also hold a token id (`tokens`): with defer_readback a CODA's sampled id is put
in the row of the position it feeds, before that position's PRELUDE, which embeds it from
there (`embed_ids`) whether or not the host has read it yet.

Two slab rows are never handed out: ZERO (hidden 0, aux 1) is what padding rows of a CUDA-graph
batch gather, SINK is where they scatter, so a graph can gather and scatter the state itself
with one static index per row. Captured graphs hold the slab's address: `version` changes when
the slab grows and they must be captured again.
"""

from __future__ import annotations

import torch


ZERO, SINK = 0, 1  # reserved slab rows (see the module docstring)


class StateStore:
    def __init__(self, width: int, dtype: torch.dtype, device: torch.device, capacity: int = 256) -> None:
        self.width, self.dtype, self.device = width, dtype, device
        capacity += SINK + 1
        self.hidden = torch.empty(capacity, width, dtype=dtype, device=device)
        self.aux = torch.empty(capacity, dtype=torch.float32, device=device)
        self.tokens = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.hidden[ZERO].zero_()
        self.aux[ZERO] = 1.0
        self._free = list(range(capacity - 1, SINK, -1))
        self._rows: dict[str, dict[int, int]] = {}  # request -> position -> slab row
        self.version = 0  # bumped when the slab moves (grows)

    def _grow(self, need: int) -> None:
        old = self.hidden.shape[0]
        new = max(2 * old, old + need)
        # Normal tensors, not inference tensors, whatever mode the caller runs in: the slab is
        # written both inside the runner's inference_mode and outside it (put_tokens).
        with torch.inference_mode(False):
            self.hidden = torch.cat([self.hidden, self.hidden.new_empty(new - old, self.width)])
            self.aux = torch.cat([self.aux, self.aux.new_empty(new - old)])
            self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(new - old)])
        self._free[:0] = range(new - 1, old - 1, -1)  # popped from the end: low rows first
        self.version += 1

    def rows(self, items: list[tuple[str, list[int]]], assign: bool = False) -> list[int]:
        """Slab rows of every (request, positions) in order, a host list that travels in the
        batch's one host-to-device copy; `assign` gives positions that have none a fresh row
        (a PRELUDE's new rows)."""
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
        return out

    def get(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hidden.index_select(0, rows), self.aux.index_select(0, rows)

    def put(self, rows: torch.Tensor, hidden: torch.Tensor, aux: torch.Tensor) -> None:
        self.hidden.index_copy_(0, rows, hidden.to(self.dtype))
        self.aux.index_copy_(0, rows, aux.float())

    def holds(self, request_id: str, position: int) -> bool:
        return position in self._rows.get(request_id, ())

    def put_tokens(self, rows: torch.Tensor, ids: torch.Tensor) -> None:
        self.tokens.index_copy_(0, rows, ids)

    def embed_ids(self, token_ids: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """A PRELUDE's token ids: those the host left -1 come from the rows' slab tokens."""
        return torch.where(token_ids >= 0, token_ids, self.tokens.index_select(0, rows))

    def drop(self, request_id: str) -> None:
        self._free += self._rows.pop(request_id, {}).values()

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._rows

    @property
    def rows_in_use(self) -> int:
        return self.capacity - len(self._free)

    @property
    def capacity(self) -> int:
        """Rows that can be handed out (the reserved ones not counted)."""
        return self.hidden.shape[0] - SINK - 1
