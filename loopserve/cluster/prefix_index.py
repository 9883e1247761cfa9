"""Which prompt prefixes the router sent to each entry worker, to route a request where its
prefix is likely cached (approximate, as SGLang's cache-aware router: the router's own
history, not the workers' caches, so a prefix a worker has evicted still counts).

Prompts are cut into chunks (token ids, or characters of a text prompt: the router has no
tokenizer) keyed by a hash chain, so equal keys mean equal prefixes. The index is bounded:
past `capacity` chunk keys the least recently routed go first.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

CHUNK = 64  # tokens or characters per key: short prompts share nothing worth routing for


def prefix_keys(prompt: str | list[int]) -> list[bytes]:
    """Hash chain of the prompt's full chunks (up to the first bad token id: the worker
    refuses such a prompt, routing need not)."""
    keys: list[bytes] = []
    if not isinstance(prompt, (str, list)):
        return keys
    parent = b""
    for start in range(0, len(prompt) - CHUNK + 1, CHUNK):
        piece = prompt[start:start + CHUNK]
        try:
            data = piece.encode() if isinstance(piece, str) else array("q", piece).tobytes()
        except (TypeError, OverflowError, UnicodeEncodeError):
            break
        parent = hashlib.blake2b(parent + data, digest_size=16).digest()
        keys.append(parent)
    return keys


class PrefixIndex:
    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._workers: OrderedDict[bytes, set[str]] = OrderedDict()  # key -> workers, LRU first

    def match(self, keys: list[bytes]) -> dict[str, int]:
        """Leading chunks of `keys` each worker was sent (workers with none are left out)."""
        out: dict[str, int] = {}
        alive: set[str] | None = None
        for n, k in enumerate(keys, 1):
            here = self._workers.get(k)
            alive = set(here or ()) if alive is None else alive & (here or set())
            if not alive:
                break
            for w in alive:
                out[w] = n
        return out

    def record(self, worker_id: str, keys: list[bytes]) -> None:
        for k in keys:
            self._workers.setdefault(k, set()).add(worker_id)
            self._workers.move_to_end(k)
        while len(self._workers) > self.capacity:
            self._workers.popitem(last=False)

    def forget(self, worker_id: str) -> None:
        """The worker lost its cache (failed or restarted)."""
        for k in [k for k, ws in self._workers.items() if worker_id in ws]:
            ws = self._workers[k]
            ws.discard(worker_id)
            if not ws:
                del self._workers[k]
