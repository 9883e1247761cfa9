"""A gRPC client cancels its stream in every state of a PD request; the abort reaches both
engines and nothing leaks (the conftest checks every pool after each test).

The fault workers make each state last: prefill engines admit one request at a time in
4-token chunks (a long prompt stays ACTIVE prefill, the next one WAITING), and decode
workers hold every READ for 1 s (TRANSFERRING on the prefill side, RECEIVING on decode).
"""

from __future__ import annotations

import pytest

from loopserve.protocol.sampling_params import SamplingParams
from tests.cluster.conftest import served_1p1d, until

LONG = SamplingParams(max_tokens=100, ignore_eos=True, max_loops=2)
PREFILL_TRACE = ["WAITING", "ACTIVE", "TRANSFERRING", "FINISHED"]


@pytest.fixture(scope="module")
def pair(fault_workers):
    with served_1p1d(fault_workers) as s:
        yield s


def _finished(*workers_and_ids) -> None:
    for w, rid in workers_and_ids:
        until(lambda: w.trace(rid)[-1:] == ["FINISHED"], 30, f"{rid} FINISHED on {w.worker_id}")


def test_cancel_while_waiting_and_while_prefilling(pair):
    client, p, d = pair
    blocker = client.stream([1 + i % 200 for i in range(400)], LONG, "c-prefilling")
    until(lambda: p.trace("c-prefilling")[-1:] == ["ACTIVE"])
    queued = client.stream([9, 8, 7], LONG, "c-waiting")
    until(lambda: p.trace("c-waiting") == ["WAITING"])
    queued.cancel()
    _finished((p, "c-waiting"))
    assert p.trace("c-prefilling")[-1:] == ["ACTIVE"]  # still prefilling: cancel it there
    blocker.cancel()
    _finished((p, "c-prefilling"))
    assert p.trace("c-waiting") == ["WAITING", "FINISHED"]
    assert p.trace("c-prefilling") == ["WAITING", "ACTIVE", "FINISHED"]
    assert d.trace("c-waiting") == d.trace("c-prefilling") == []


@pytest.mark.parametrize("worker,status", [("prefill", "TRANSFERRING"), ("decode", "RECEIVING"),
                                           ("decode", "ACTIVE")])
def test_cancel_during_transfer_and_decode(pair, worker, status):
    client, p, d = pair
    rid = f"c-{status.lower()}"
    aborted = d.stats().engine.counters.requests_aborted
    call = client.stream([4, 5, 6, 7, 8], LONG, rid)
    w = p if worker == "prefill" else d
    until(lambda: w.trace(rid)[-1:] == [status], 30, f"{rid} {status}")
    call.cancel()
    _finished((p, rid))
    assert p.trace(rid) == PREFILL_TRACE
    if status == "TRANSFERRING" and not d.trace(rid):
        return  # cancelled before the handoff reached the decode side: it never will
    _finished((d, rid))
    if status == "TRANSFERRING" and d.trace(rid) == ["FINISHED"]:
        return  # still in the decode side's inbox, before its READ (a loaded machine): dropped there
    # The READ is held 1 s, so a cancel at TRANSFERRING finds the decode side RECEIVING.
    assert d.trace(rid) == (["RECEIVING", "ACTIVE", "FINISHED"] if status == "ACTIVE"
                            else ["RECEIVING", "FINISHED"])
    # A request aborted while its READ is in flight leaves the engine when the READ retires.
    until(lambda: d.stats().engine.counters.requests_aborted == aborted + 1, 30, f"{rid} aborted on decode")
