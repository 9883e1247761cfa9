"""EngineLock: the one lock around every engine call, where RPC callers go before the next step.

With a plain lock the step loop, which holds the GIL, re-acquires right after releasing, so
a submit or abort could wait through many steps. Callers announce themselves; the loop lets
them in before it takes the lock again.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

STEP_YIELD_S = 0.01  # the loop never waits longer than this for callers to get through


class EngineLock:
    def __init__(self) -> None:
        self._lock = threading.RLock()  # reentrant: RPC methods call each other
        self._cv = threading.Condition()
        self._waiting = 0

    def __enter__(self) -> None:
        """An RPC caller: counted as waiting until it holds the lock."""
        with self._cv:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._cv:
                self._waiting -= 1
                self._cv.notify_all()

    def __exit__(self, *exc) -> None:
        self._lock.release()

    @contextmanager
    def step(self) -> Iterator[None]:
        """The step loop: first let waiting callers through, then hold the lock for one tick."""
        with self._cv:
            self._cv.wait_for(lambda: self._waiting == 0, timeout=STEP_YIELD_S)
        with self._lock:
            yield
