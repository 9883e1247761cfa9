"""Two engines (prefill, decode) with a real NIXL READ between them == one colocated engine.

No Ray here: this is the engine-level PD path the workers wrap.
"""

import pytest

from loopserve.scheduler import RequestStatus
from tests.engine.conftest import make_engine, reference, run_pd, workload


@pytest.mark.parametrize("family", ["tiny-huginn", "tiny-ouro"])
def test_prefill_decode_handoff_equals_dense(family):
    p = make_engine(family, role="prefill")
    d = make_engine(family, role="decode", block_size=4)
    work = workload(seed=7, n=6)
    for rid, prompt, params in work:
        p.add_request(prompt, params, request_id=rid)
    run = run_pd(p, d)
    for rid, prompt, params in work:
        tokens, _ = reference(family, prompt, params)
        assert run.tokens[rid] == list(tokens), rid
        assert RequestStatus.TRANSFERRING in run.states_p[rid]
        assert run.states_d[rid][:2] == [RequestStatus.RECEIVING, RequestStatus.ACTIVE]


class _BusyMachineClock:
    """The `time` module as a very busy machine sees it: 100 s pass between any two reads
    of the clock; sleeping is real."""

    def __init__(self) -> None:
        import time

        self._real, self._now = time, 0.0

    def _tick(self) -> float:
        self._now += 100.0
        return self._now

    time = monotonic = perf_counter = _tick

    def sleep(self, seconds: float) -> None:
        self._real.sleep(seconds)


def test_run_pd_is_bounded_by_progress_not_by_the_clock(monkeypatch):
    """Issue 38 finding 9: run_pd gave up after 60 s of wall clock ("PD pipeline did not
    drain" under load); now only rounds without progress count, so a pipeline that moves
    drains whatever the clock says."""
    from tests.engine import conftest

    monkeypatch.setattr(conftest, "time", _BusyMachineClock())
    p = make_engine("tiny-ouro", role="prefill")
    d = make_engine("tiny-ouro", role="decode")
    work = workload(seed=8, n=3)
    for rid, prompt, params in work:
        p.add_request(prompt, params, request_id=rid)
    run = run_pd(p, d)
    for rid, prompt, params in work:
        assert run.tokens[rid] == list(reference("tiny-ouro", prompt, params)[0]), rid
