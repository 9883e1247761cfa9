"""Test-side fault injection: an engine step that raises, as a faulting CUDA kernel would.

loopserve has no switch for it: tests break a live engine's runner from here, in this process
(`break_engine(host)`) or inside a Ray actor of `FaultyHost`, a colocated worker with one more
method (Ray imports this module in the actor's process, which has the checkout on its path).
"""

from __future__ import annotations

from loopserve.prefill_worker.host import EngineHost

FAULT = "injected device fault"


def break_engine(host: EngineHost) -> None:
    """Every RECURRENT batch the host's engine runs from now on raises."""
    def broken(*args, **kwargs):
        raise RuntimeError(FAULT)

    host.engine.runner.recurrent = broken


class FaultyHost(EngineHost):
    def break_engine(self) -> None:
        break_engine(self)
