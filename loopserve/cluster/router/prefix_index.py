"""Which worker's prefix cache holds which block, as the workers report it (their KV events:
`kv_cache/prefix_cache.py` CacheEvents, carried by every event poll), so the router sends a
request where the longest part of its prompt is cached (Dynamo's KV router, vLLM's KV events).

Keys are the engines' own block keys; the router computes a new request's keys with the
worker's `PrefixKeyer`. The index lags a worker by at most one poll: a block it reports
stored may be gone by the time the request arrives, which costs a recompute, never a wrong
token (the worker looks its cache up itself).
"""

from __future__ import annotations

from collections.abc import Sequence

from loopserve.kv_cache import BlockHash, CacheEvents


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[str]] = {}  # key -> workers whose cache holds it
        self._held: dict[str, set[BlockHash]] = {}  # worker -> its keys

    def apply(self, worker_id: str, events: CacheEvents) -> None:
        if events.reset:
            self.forget(worker_id)
        held = self._held.setdefault(worker_id, set())
        for stored, key in events.changes:
            if stored:
                held.add(key)
                self._holders.setdefault(key, set()).add(worker_id)
            elif key in held:
                held.discard(key)
                holders = self._holders[key]
                holders.discard(worker_id)
                if not holders:
                    del self._holders[key]

    def match(self, keys: Sequence[BlockHash], workers: Sequence[str]) -> dict[str, int]:
        """Leading blocks of `keys` each of `workers` holds."""
        out = dict.fromkeys(workers, 0)
        alive = set(workers)
        for n, k in enumerate(keys, 1):
            alive &= self._holders.get(k, set())
            if not alive:
                break
            for w in alive:
                out[w] = n
        return out

    def forget(self, worker_id: str) -> None:
        """The worker lost its cache (failed or restarted), or reports it anew."""
        for key in self._held.pop(worker_id, ()):
            holders = self._holders[key]
            holders.discard(worker_id)
            if not holders:
                del self._holders[key]

    def num_blocks(self, worker_id: str) -> int:
        return len(self._held.get(worker_id, ()))
