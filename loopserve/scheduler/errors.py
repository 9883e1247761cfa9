"""Errors the scheduler raises on purpose (bad input raises ValueError naming the field)."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """Backpressure: the waiting queue holds max_waiting requests; retry later or elsewhere."""


class DuplicateSelectionError(RuntimeError):
    """A request was queued or selected for a second WorkKey while one was still pending.

    Raised instead of overwriting the entry, which would silently drop a queue position.
    """
