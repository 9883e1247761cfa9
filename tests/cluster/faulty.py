"""Test-side fault injection: an engine step that raises, as a faulting CUDA kernel would.

loopserve has no switch for it: tests break a live engine's runner from here, in this process
(`break_engine(host)`) or inside a Ray actor of `FaultyHost`, a colocated worker with one more
method (Ray imports this module in the actor's process, which has the checkout on its path).
"""

from __future__ import annotations

from loopserve.worker_host.host import EngineHost

FAULT = "injected device fault"


def break_engine(host: EngineHost, after_tokens: int = 0) -> None:
    """From now on, a RECURRENT batch of the host's engine raises once a request in it has
    `after_tokens` output tokens (0: the next one raises)."""
    real = host.engine.runner.recurrent

    def broken(batch, reqs, *args, **kwargs):
        if any(len(r.output_token_ids) >= after_tokens for r in reqs.values()):
            raise RuntimeError(FAULT)
        return real(batch, reqs, *args, **kwargs)

    host.engine.runner.recurrent = broken


class FaultyHost(EngineHost):
    def break_engine(self) -> None:
        break_engine(self)
