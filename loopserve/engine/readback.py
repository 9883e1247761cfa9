"""Deferred read-back (defer_readback): CODA samples left on the device until the host needs them.

The next PRELUDE embeds a drawn token straight from the device, so the host need not wait for
it; the engine applies a request's samples later, in order, before anything reads them (its
next CODA, its final output). This module holds what is still unread; the engine applies it.
"""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.engine.sampler import DrawnTokens, Sample

UNREAD = -1  # the token a deferred sample reports to the scheduler (which counts, never reads, them)


@dataclass
class UnreadBatch:
    """One CODA's samples not yet applied on the host."""

    drawn: DrawnTokens
    rows: dict[str, tuple[int, int]]  # request -> (row in drawn, position that produced it)


class UnreadSamples:
    """Unread batches, oldest first; a request has at most one sample among them."""

    def __init__(self) -> None:
        self._batches: list[UnreadBatch] = []

    def add(self, batch: UnreadBatch) -> None:
        self._batches.append(batch)

    def take(self, only: set[str] | None = None, wait: bool = False) -> list[tuple[str, Sample, int]]:
        """(request, sample, producing position) of the samples already drawn, or (wait) of
        every request in `only`; they are no longer held."""
        got: list[tuple[str, Sample, int]] = []
        for u in list(self._batches):
            rids = list(u.rows) if only is None else [r for r in u.rows if r in only]
            if not rids or not (wait or u.drawn.ready()):
                continue
            samples = u.drawn.samples()
            for rid in rids:
                row, pos = u.rows.pop(rid)
                got.append((rid, samples[row], pos))
            if not u.rows:
                self._batches.remove(u)
        return got

    def drop(self, request_id: str) -> None:
        """Forget a request's sample unread (it was aborted)."""
        for u in self._batches:
            u.rows.pop(request_id, None)
        self._batches = [u for u in self._batches if u.rows]

    def clear(self) -> None:
        self._batches = []

    def requests(self) -> list[str]:
        return [rid for u in self._batches for rid in u.rows]

    def __contains__(self, request_id: str) -> bool:
        return any(request_id in u.rows for u in self._batches)

    def __len__(self) -> int:
        return len(self._batches)
