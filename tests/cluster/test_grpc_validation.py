"""Fuzzing the wire: hypothesis-made GenerateRequests against ONE real gRPC server (over an
in-process colocated worker of the tiny model).

Every valid request completes; every request broken in one place (a number out of range, an
empty or oversize prompt, too many or too long stop strings, an oversize id) gets
INVALID_ARGUMENT naming that field; raw bytes that are not a GenerateRequest (a known field
with the wrong wire type, invalid UTF-8, truncation, noise) get INVALID_ARGUMENT and never
crash the server; a live request's id gets ALREADY_EXISTS. Afterwards the server still says
SERVING and no KV block is held (the conftest checks the pools after every test).
"""

from __future__ import annotations

import math

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor
from hypothesis import given, settings, strategies as st

from loopserve.entrypoints.grpc.proto import loopserve_pb2 as pb
from tests.cluster.conftest import ENGINE, serving

VOCAB, MAX_LOOPS, MAX_MODEL_LEN = 384, 4, ENGINE["max_model_len"]  # tiny-huginn's bounds
LIMITS = {"max_message_bytes": 64 << 10, "max_prompt_bytes": 2048, "max_request_id_bytes": 64,
          "max_stop": 4, "max_stop_bytes": 16, "max_stop_token_ids": 8}
GENERATE = "/loopserve.v1.LoopServe/Generate"
FUZZ = settings(max_examples=60, deadline=None)

INT32 = st.integers(-2**31, 2**31 - 1)
FLOAT32 = st.floats(width=32)  # every float32, NaN and infinities included
NASTY = st.sampled_from([math.nan, math.inf, -math.inf, -0.0, 0.0])


@pytest.fixture(scope="module")
def client(colocated_router):
    with serving(colocated_router, limits=LIMITS) as c:
        yield c


def send(client, raw: bytes, read_all: bool = True) -> tuple[grpc.StatusCode, str, list]:
    """Generate with raw request bytes: (status, details, responses); with read_all False,
    only the first response is read, then the stream is cancelled."""
    call = client.channel.unary_stream(GENERATE, request_serializer=None,
                                       response_deserializer=pb.GenerateResponse.FromString)(raw)
    try:
        got = list(call) if read_all else [next(call)]
    except grpc.RpcError as e:
        return e.code(), e.details(), []
    call.cancel()
    return grpc.StatusCode.OK, "", got


def _maybe(draw, msg, name: str, values: st.SearchStrategy) -> None:
    if draw(st.booleans()):
        setattr(msg, name, draw(values))


@st.composite
def valid_requests(draw) -> pb.GenerateRequest:
    req = pb.GenerateRequest(request_id=draw(st.just("") | st.text(min_size=1, max_size=16)),
                             priority=draw(INT32))
    if draw(st.booleans()):
        req.text = draw(st.text(min_size=1, max_size=40))
    else:
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40)))
    s = req.sampling
    s.max_tokens = draw(st.integers(1, 4))
    s.ignore_eos = draw(st.booleans())
    _maybe(draw, s, "temperature", st.floats(0, allow_nan=False, allow_infinity=False, width=32))  # subnormals too: greedy
    _maybe(draw, s, "top_k", st.integers(-1, 2 * VOCAB))
    _maybe(draw, s, "top_p", st.floats(0, 1, exclude_min=True, width=32))
    _maybe(draw, s, "seed", st.integers(0, 2**63 - 1))
    _maybe(draw, s, "logprobs", st.integers(0, 20))
    s.stop.extend(draw(st.lists(st.text(min_size=1, max_size=4), max_size=4)))
    s.stop_token_ids.extend(draw(st.lists(INT32, max_size=8)))
    lo = draw(st.integers(1, MAX_LOOPS))
    _maybe(draw, req.loops, "min_loops", st.just(lo))
    _maybe(draw, req.loops, "max_loops", st.integers(lo, MAX_LOOPS))
    _maybe(draw, req.loops, "exit_threshold", st.floats(0, 1, width=32))
    return req


def _setter(path: str):
    def apply(req: pb.GenerateRequest, value) -> None:
        *parents, leaf = path.split(".")
        msg = req
        for p in parents:
            msg = getattr(msg, p)
        setattr(msg, leaf, value)
    return apply


def _token_prompt(req: pb.GenerateRequest, ids: list[int]) -> None:
    req.token_ids.SetInParent()  # selects token_ids in the oneof, even when ids is empty
    req.token_ids.ClearField("ids")
    req.token_ids.ids.extend(ids)


def _repeated(path: str):
    def apply(req: pb.GenerateRequest, values: list) -> None:
        field = getattr(req.sampling, path)
        del field[:]
        field.extend(values)
    return apply


def _ints(*ranges: tuple[int, int]) -> st.SearchStrategy[int]:
    return st.one_of(*(st.integers(lo, hi) for lo, hi in ranges))


# (what is broken, how to break it, with what, a substring the reason must contain)
BREAKS = [
    ("max_tokens", _setter("sampling.max_tokens"), _ints((-2**31, 0), (MAX_MODEL_LEN, 2**31 - 1)), "max_tokens"),
    ("temperature", _setter("sampling.temperature"),
     (NASTY | FLOAT32).filter(lambda x: not (math.isfinite(x) and x >= 0)), "temperature"),
    ("top_k", _setter("sampling.top_k"), st.integers(-2**31, -2), "top_k"),
    # 7 significant digits is what a float32 holds: 1.0000001 on the wire is 1
    ("top_p", _setter("sampling.top_p"), (NASTY | FLOAT32).filter(lambda x: not 0 < x <= 1.000001), "top_p"),
    ("seed", _setter("sampling.seed"), st.integers(2**63, 2**64 - 1), "seed"),
    ("logprobs", _setter("sampling.logprobs"), _ints((-2**31, -1), (21, 2**31 - 1)), "logprobs"),
    ("min_loops", _setter("loops.min_loops"), _ints((-2**31, 0), (MAX_LOOPS + 1, 2**31 - 1)), "min_loops"),
    ("max_loops", _setter("loops.max_loops"), _ints((-2**31, 0), (MAX_LOOPS + 1, 2**31 - 1)), "max_loops"),
    ("exit_threshold", _setter("loops.exit_threshold"),
     (NASTY | FLOAT32).filter(lambda x: not 0 <= x <= 1.000001), "exit_threshold"),
    ("request_id", _setter("request_id"), st.text(min_size=65, max_size=100), "max_request_id_bytes (64)"),
    ("text bytes", _setter("text"), st.integers(2049, 60000).map(lambda n: "é" * (n // 2 + 1)),
     "max_prompt_bytes (2048)"),
    ("text tokens", _setter("text"), st.integers(MAX_MODEL_LEN, 2048).map(lambda n: "y" * n),
     f"max_model_len ({MAX_MODEL_LEN})"),
    ("empty text", _setter("text"), st.just(""), "prompt.text must not be empty"),
    ("no prompt", lambda req, _: req.ClearField("prompt"), st.none(), "prompt must be set"),
    ("empty token ids", _token_prompt, st.just([]), "prompt.token_ids must not be empty"),
    ("token id", _token_prompt, st.lists(st.integers(0, VOCAB - 1), max_size=8).flatmap(
        lambda ok: _ints((-2**31, -1), (VOCAB, 2**31 - 1)).map(lambda bad: ok + [bad])),
     f"outside the vocabulary [0, {VOCAB})"),
    ("token count", _token_prompt, st.integers(MAX_MODEL_LEN, 2048).map(lambda n: [7] * n),
     f"max_model_len ({MAX_MODEL_LEN})"),
    ("stop count", _repeated("stop"), st.lists(st.text(min_size=1, max_size=4), min_size=5, max_size=12),
     "max_stop (4)"),
    ("stop length", _repeated("stop"), st.text(st.characters(max_codepoint=127), min_size=17,
                                               max_size=64).map(lambda s: [s]), "max_stop_bytes (16)"),
    ("empty stop", _repeated("stop"), st.just([""]), "stop strings must be non-empty"),
    ("stop token ids", _repeated("stop_token_ids"), st.lists(INT32, min_size=9, max_size=40),
     "max_stop_token_ids (8)"),
]


@FUZZ
@given(req=valid_requests())
def test_every_valid_request_completes(client, req):
    code, details, got = send(client, req.SerializeToString())
    assert code == grpc.StatusCode.OK, details
    last = got[-1]
    assert last.WhichOneof("response") == "complete", last
    assert last.complete.finish_reason in ("length", "stop")
    assert 1 <= last.complete.completion_tokens <= req.sampling.max_tokens


@pytest.mark.parametrize("what, apply, values, needle", BREAKS, ids=[b[0] for b in BREAKS])
@settings(max_examples=15, deadline=None)
@given(base=valid_requests(), data=st.data())
def test_a_request_broken_in_one_place_is_invalid_argument_naming_it(client, what, apply, values,
                                                                     needle, base, data):
    apply(base, data.draw(values, label=what))
    code, details, _ = send(client, base.SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (what, details)
    assert needle in details, (what, details)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        out.append((n & 0x7F) | (0x80 if n > 0x7F else 0))
        n >>= 7
        if not n:
            return bytes(out)


def _field(number: int, wire_type: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire_type) + payload


def _len(number: int, body: bytes) -> bytes:
    return _field(number, 2, _varint(len(body)) + body)


_PAYLOADS = {0: b"\x05", 1: b"\x00" * 8, 2: b"\x01a", 5: b"\x00" * 4}  # varint, i64, len, i32


def _wire_type(f: FieldDescriptor) -> set[int]:
    """The wire types protobuf accepts for a field (repeated numbers: packed or not)."""
    if f.type in (f.TYPE_STRING, f.TYPE_BYTES, f.TYPE_MESSAGE):
        return {2}
    own = {f.TYPE_FLOAT: 5, f.TYPE_DOUBLE: 1}.get(f.type, 0)
    return {own, 2} if f.is_repeated else {own}


def _known_fields(desc, outer: tuple[int, ...] = (), where: str = ""):
    """(path of enclosing field numbers, field, dotted name) of every field, nested too."""
    for f in desc.fields:
        yield outer, f, where + f.name
        if f.message_type is not None:
            yield from _known_fields(f.message_type, outer + (f.number,), f"{where}{f.name}.")


WIRE_FIELDS = list(_known_fields(pb.GenerateRequest.DESCRIPTOR))


def _nest(outer: tuple[int, ...], body: bytes) -> bytes:
    for number in reversed(outer):
        body = _len(number, body)
    return body


@st.composite
def wire_breaks(draw) -> tuple[bytes, str]:
    """Valid request bytes with something appended that makes them invalid, and the reason."""
    raw = draw(valid_requests()).SerializeToString()
    kind = draw(st.sampled_from(["wire type", "utf-8", "truncated"]))
    if kind == "wire type":
        outer, f, name = draw(st.sampled_from(WIRE_FIELDS))
        wrong = draw(st.sampled_from(sorted(set(_PAYLOADS) - _wire_type(f))))
        return raw + _nest(outer, _field(f.number, wrong, _PAYLOADS[wrong])), f"{name} has the wrong wire type"
    if kind == "utf-8":  # 0xff never occurs in UTF-8; request_id, text or one stop string
        text = draw(st.text(max_size=6)).encode()
        bad = text[: len(text) // 2] + b"\xff" + text[len(text) // 2:]
        outer, number = draw(st.sampled_from([((), 1), ((), 2), ((4,), 7)]))
        return raw + _nest(outer, _len(number, bad)), "bad UTF-8"
    body = draw(st.binary(max_size=8))  # a prompt whose declared length runs past the end
    return raw + _field(2, 2, _varint(len(body) + draw(st.integers(1, 100)))) + body, "not a valid GenerateRequest"


@FUZZ
@given(case=wire_breaks())
def test_bytes_that_are_not_a_generate_request_are_invalid_argument(client, case):
    raw, needle = case
    code, details, _ = send(client, raw)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, details
    assert needle in details and "GenerateRequest" in details, details


@FUZZ
@given(raw=st.binary(max_size=64))
def test_random_bytes_are_served_or_refused_never_a_crash(client, raw):
    code, details, got = send(client, raw, read_all=False)
    if code == grpc.StatusCode.OK:
        assert got[0].WhichOneof("response") in ("chunk", "complete")
    else:
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details


@settings(max_examples=10, deadline=None)
@given(request_id=st.text(min_size=1, max_size=16))
def test_the_id_of_a_live_request_is_already_exists(client, request_id):
    live = pb.GenerateRequest(request_id=request_id, text="hold", sampling=pb.SamplingParams(
        max_tokens=400, ignore_eos=True))
    call = client.stub.Generate(live)
    next(call)  # it is live now
    code, details, _ = send(client, pb.GenerateRequest(request_id=request_id, text="again").SerializeToString())
    assert code == grpc.StatusCode.ALREADY_EXISTS and "already in use" in details
    assert client.abort(request_id)
    assert list(call)[-1].complete.finish_reason == "abort"


def test_a_message_over_max_message_bytes_is_refused_by_grpc(client):
    code, details, _ = send(client, _len(2, b"z" * (LIMITS["max_message_bytes"] + 1)))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED, details


def test_the_server_still_serves_after_the_fuzz(client):
    assert client.health_check() == "SERVING" and client.health().healthy
    ok = client.stub.Generate(pb.GenerateRequest(text="still here", sampling=pb.SamplingParams(max_tokens=2)))
    assert list(ok)[-1].complete.completion_tokens == 2
    (worker,) = client.stats().workers
    assert worker.healthy and worker.pool_accounting_ok
