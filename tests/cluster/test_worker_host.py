"""The worker host's event poll never waits for the engine: a worker in the middle of a long
step still answers (with its load as of its last step), so the router can tell a busy worker
from a hung one."""

from __future__ import annotations

import threading

from loopserve.protocol.sampling_params import SamplingParams
from loopserve.worker_host.host import EngineHost
from tests.cluster.conftest import ENGINE


def test_a_poll_is_answered_while_a_step_is_running():
    host = EngineHost("busy", {**ENGINE, "async_scheduling": False})  # the step runs under the lock
    entered, release = threading.Event(), threading.Event()
    real = host.engine.runner.recurrent

    def long_step(*args, **kwargs):
        entered.set()
        release.wait(60)  # the step lasts until the test lets it go
        return real(*args, **kwargs)

    host.engine.runner.recurrent = long_step
    try:
        host.submit("r", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
        assert entered.wait(60), "the step never started"
        ev = host.get_events(0.01)  # answered with the step still running
        assert not release.is_set() and ev.load.accepted == 1 and ev.load.healthy
    finally:
        release.set()
        host.engine.runner.recurrent = real
        host.shutdown()
