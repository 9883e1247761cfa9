"""The gRPC server with a real client over a real 1P1D Ray cluster: stream, cancel, health, errors."""

from __future__ import annotations

import grpc
import pytest

from loopserve.bench.workload import WorkItem
from loopserve.cluster.cluster import wait_idle
from loopserve.entrypoints.grpc.server import SERVICE
from loopserve.protocol.sampling_params import SamplingParams
from tests.cluster.conftest import colocated_reference, served_1p1d, until


@pytest.fixture(scope="module")
def served(pd_workers):
    with served_1p1d(pd_workers) as s:
        yield s


def test_stream_first_token_then_decode_tokens(served):
    client, p, d = served
    params = SamplingParams(max_tokens=7, ignore_eos=True, exit_threshold=0.7, seed=5)
    events = list(client.generate("stream me", params, request_id="g-stream"))
    chunks = [e for e in events if e.kind == "chunk"]
    assert events[-1].kind == "complete" and events[-1].finish_reason == "length"
    assert events[-1].completion_tokens == 7
    assert len(chunks[0].token_ids) == 1  # the prefill side's first token, streamed on its own
    tokens = [t for c in chunks for t in c.token_ids]
    depths = [x for c in chunks for x in c.exit_depths]
    ref = colocated_reference([WorkItem("g-stream", "stream me", params)])["g-stream"]
    assert (tokens, depths) == ref
    assert "".join(c.text for c in chunks) == bytes(t for t in tokens if t < 256).decode("utf-8", "replace")


def test_cancel_aborts_on_both_engines(served):
    client, p, d = served
    aborted_before = d.stats().engine.counters.requests_aborted
    call = client.stream("cancel me", SamplingParams(max_tokens=400, ignore_eos=True), "g-cancel")
    got = [next(call), next(call)]  # the second chunk comes from the decode side
    assert all(r.WhichOneof("response") == "chunk" for r in got)
    call.cancel()
    until(lambda: d.trace("g-cancel")[-1:] == ["FINISHED"])
    assert p.trace("g-cancel") == ["WAITING", "ACTIVE", "TRANSFERRING", "FINISHED"]
    assert d.trace("g-cancel") == ["RECEIVING", "ACTIVE", "FINISHED"]
    assert d.stats().engine.counters.requests_aborted == aborted_before + 1
    usage = wait_idle([p, d])
    assert all(u["looped"]["used"] == 0 for u in usage.values())


def test_cancel_right_after_first_token_leaves_nothing(served):
    """Cancelled while the handoff is in transit: whichever engine holds it frees it."""
    client, p, d = served
    for i in range(3):
        call = client.stream("quick cancel", SamplingParams(max_tokens=300, ignore_eos=True), f"g-qc{i}")
        next(call)
        call.cancel()
    for i in range(3):
        until(lambda: p.trace(f"g-qc{i}")[-1:] == ["FINISHED"])
    wait_idle([p, d])


def test_abort_rpc_ends_the_stream(served):
    client, p, d = served
    call = client.stream("abort me", SamplingParams(max_tokens=400, ignore_eos=True), "g-abort")
    next(call)
    assert client.abort("g-abort") is True
    last = list(call)[-1]
    assert last.WhichOneof("response") == "complete" and last.complete.finish_reason == "abort"
    assert client.abort("g-abort") is False  # no longer live
    wait_idle([p, d])


def test_health(served):
    client, _, _ = served
    assert client.health_check("") == "SERVING"
    assert client.health_check(SERVICE) == "SERVING"
    h = client.health()
    assert h.healthy and h.status == "SERVING"


def test_stats(served):
    client, p, d = served
    wait_idle([p, d])
    stats = {w.worker_id: w for w in client.stats().workers}
    assert set(stats) == {p.worker_id, d.worker_id}
    for w in stats.values():
        assert w.healthy and w.pool_accounting_ok
        assert w.looped.total == 1024 and w.looped.used == 0
        assert w.counters["batches_PRELUDE"] > 0
    assert stats[p.worker_id].role == "prefill" and stats[d.worker_id].counters["kv_reads_count"] > 0


@pytest.mark.parametrize("prompt, params, field", [
    ("x", SamplingParams(max_tokens=4, top_p=0.5), None),  # control: valid
    ([], SamplingParams(max_tokens=4), "prompt"),
    ([1, 99999], SamplingParams(max_tokens=4), "prompt token id"),
    ("x" * 600, SamplingParams(max_tokens=4), "max_model_len"),
])
def test_bad_request_is_invalid_argument(served, prompt, params, field):
    client, _, _ = served
    if field is None:
        assert list(client.generate(prompt, params))[-1].kind == "complete"
        return
    with pytest.raises(grpc.RpcError) as e:
        list(client.generate(prompt, params))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


@pytest.mark.parametrize("mutate, field", [
    (lambda r: r.sampling.__setattr__("max_tokens", 0), "max_tokens"),
    (lambda r: r.sampling.__setattr__("top_p", 2.0), "top_p"),
    (lambda r: r.sampling.__setattr__("seed", 2**63), "seed"),
    (lambda r: r.loops.__setattr__("max_loops", 99), "max_loops"),
    (lambda r: r.loops.__setattr__("exit_threshold", 1.5), "exit_threshold"),
    (lambda r: r.ClearField("prompt"), "prompt"),
])
def test_malformed_message_names_the_field(served, mutate, field):
    from loopserve.entrypoints.grpc.protocol import request_to_proto

    client, _, _ = served
    req = request_to_proto("hi", SamplingParams(max_tokens=4))
    mutate(req)
    with pytest.raises(grpc.RpcError) as e:
        list(client.stub.Generate(req))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in e.value.details()


def test_request_id_in_use_then_reusable(served):
    client, p, d = served
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    live = client.stream("first", params, "g-dup")
    next(live)
    with pytest.raises(grpc.RpcError) as e:
        list(client.stream("second", params, "g-dup"))
    assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "already in use" in e.value.details()
    live.cancel()
    until(lambda: not client.abort("g-dup"))  # no longer live
    again = list(client.generate("third", SamplingParams(max_tokens=3), "g-dup"))
    assert again[-1].kind == "complete" and again[-1].completion_tokens == 3
    assert all(e.request_id == "g-dup" for e in again)
    wait_idle([p, d])
