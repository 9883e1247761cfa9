"""Errors the scheduler raises on purpose (bad input raises ValueError naming the field;
backpressure raises `protocol.status.QueueFullError`, which the fronts map to a status)."""

from __future__ import annotations


class DuplicateSelectionError(RuntimeError):
    """A request was queued or selected for a second WorkKey while one was still pending.

    Raised instead of overwriting the entry, which would silently drop a queue position.
    """
