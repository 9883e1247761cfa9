"""Sampled token ids kept on the device until the PRELUDE that embeds them.

With `defer_readback` a CODA's sampled ids are not read by the host before the next
Operation is launched: each request's id goes to a slot here, and its next PRELUDE row
names the slot (`HostBatch.token_src`) instead of carrying the id, so the GPU never waits for
the host between a token's sample and its next loop. Slots are handed out and taken back
on the host; every read and write of a slot is a kernel on the one stream, so a slot taken
back while a launched PRELUDE still reads it is safe to reuse by any later write.

Captured PRELUDE graphs read `ids` by address: `version` changes when it grows.
"""

from __future__ import annotations

import torch

from loopserve.model.batch import device_tensor


class TokenStore:
    def __init__(self, device: torch.device, capacity: int = 256) -> None:
        self.device = device
        self.ids = torch.zeros(capacity, dtype=torch.int64, device=device)
        self._free = list(range(capacity - 1, -1, -1))
        self._slots: dict[str, tuple[int, int]] = {}  # request -> (slot, position it feeds)
        self.version = 0

    def put(self, request_ids: list[str], positions: list[int], ids: torch.Tensor) -> None:
        """ids[i] (a device tensor) is the input token of request_ids[i] at positions[i]."""
        slots = []
        for rid, pos in zip(request_ids, positions):
            self.drop(rid)
            if not self._free:
                self._grow()
            slot = self._free.pop()
            self._slots[rid] = (slot, pos)
            slots.append(slot)
        self.ids.index_copy_(0, device_tensor(slots, torch.int64, self.device), ids)

    def take(self, request_id: str, position: int) -> int:
        """The slot holding the request's token at `position` (given back now), or -1."""
        entry = self._slots.get(request_id)
        if entry is None or entry[1] != position:
            return -1
        del self._slots[request_id]
        self._free.append(entry[0])
        return entry[0]

    def drop(self, request_id: str) -> None:
        entry = self._slots.pop(request_id, None)
        if entry is not None:
            self._free.append(entry[0])

    def embed_ids(self, token_ids: torch.Tensor, token_src: torch.Tensor) -> torch.Tensor:
        """A batch's token ids: rows with a slot (token_src >= 0) read it, the rest keep theirs."""
        return torch.where(token_src >= 0, self.ids.index_select(0, token_src.clamp(min=0)), token_ids)

    def _grow(self) -> None:
        old = self.ids.shape[0]
        self.ids = torch.cat([self.ids, self.ids.new_zeros(old)])
        self._free[:0] = range(2 * old - 1, old - 1, -1)
        self.version += 1

    def __len__(self) -> int:
        return len(self._slots)
