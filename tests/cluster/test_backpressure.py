"""Backpressure over a real gRPC server: past server.max_pending_requests open Generate
streams, or past an engine's waiting queue, a new Generate gets RESOURCE_EXHAUSTED at once;
once streams end, new ones are served again, and no KV block is left behind."""

from __future__ import annotations

import grpc
import pytest

from loopserve.protocol.sampling_params import SamplingParams
from tests.cluster.conftest import ENGINE, serving, until
from tests.cluster.inprocess import InProcessHandle

HOLD = SamplingParams(max_tokens=400, ignore_eos=True)  # outlasts the test unless cancelled


def test_past_max_pending_requests_new_streams_are_refused_until_some_end(colocated_router):
    with serving(colocated_router, max_pending_requests=2) as client:
        held = [client.stream("hold", HOLD, f"bp-{i}") for i in range(2)]
        for call in held:
            next(call)  # both streams are open and generating
        with pytest.raises(grpc.RpcError) as e:
            list(client.stream("one too many", SamplingParams(max_tokens=2)))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.max_pending_requests (2)" in e.value.details()
        assert client.health_check() == "SERVING"  # other RPCs still answer
        assert colocated_router.num_live() == 2  # the refused one never reached the router
        for call in held:
            call.cancel()
        # The server counts a stream out before the router forgets it (then aborts it).
        until(lambda: colocated_router.num_live() == 0, what="held streams closed")
        for i in range(3):
            done = list(client.generate("again", SamplingParams(max_tokens=2), f"bp-after-{i}"))
            assert done[-1].kind == "complete" and done[-1].completion_tokens == 2


@pytest.fixture
def one_slot_worker():
    """A colocated worker that runs one request and queues one more (max_waiting=1)."""
    handle = InProcessHandle("colocated-1slot", {**ENGINE, "max_num_seqs": 1, "max_waiting": 1})
    yield handle
    handle.check_no_leaks()
    handle.shutdown()


def test_a_full_engine_queue_is_resource_exhausted(one_slot_worker, make_router):
    router = make_router([one_slot_worker])
    with serving(router) as client:
        running = client.stream("runs", HOLD, "q-running")
        next(running)
        waiting = client.stream("waits", HOLD, "q-waiting")
        until(lambda: one_slot_worker.trace("q-waiting") == ["WAITING"], what="q-waiting queued")
        with pytest.raises(grpc.RpcError) as e:
            list(client.stream("no room", HOLD, "q-full"))
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_waiting=1" in e.value.details()
        running.cancel()
        waiting.cancel()
        until(lambda: not one_slot_worker.check_no_leaks()["unfinished"], what="engine idle")
