"""The HTTP front's edges, driven with raw sockets where clients misbehave (issue 38):
bodies limited while they stream in whatever the framing (38.2), 400s naming the field and
the limit, or where the body is broken (38.5), auth before anything else (38.6), deadlines for
slow sockets and bounds on one request's fan-out (38.7). Socket timeouts only bound a hang:
no assertion is on time."""

from __future__ import annotations

import http.client
import json
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import openai
import pytest

from loopserve.cluster.cluster import wait_idle
from tests.cluster.conftest import ENGINE, http_serving

MODEL = ENGINE["model"]
LIMIT = 256 * 1024  # server.limits.max_message_bytes here
DEADLINE_S = 2.0  # header and body deadlines here
HANG_S = 30  # a socket read this long means the server did not act: the test fails
TOKEN = "s3cret"


@pytest.fixture(scope="module")
def server(colocated_router):
    with http_serving(colocated_router, limits={"max_message_bytes": LIMIT, "max_choices": 3},
                      http_header_timeout_s=DEADLINE_S, http_body_timeout_s=DEADLINE_S) as s:
        yield s


@pytest.fixture(scope="module")
def guarded(colocated_router):
    with http_serving(colocated_router, auth_token=TOKEN, limits={"max_message_bytes": LIMIT}) as s:
        yield s


def _connect(server) -> socket.socket:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.settimeout(HANG_S)
    return sock


def _head(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def _response(sock: socket.socket) -> tuple[int, dict]:
    r = http.client.HTTPResponse(sock)
    r.begin()
    return r.status, json.loads(r.read())


def _closed(sock: socket.socket) -> bool:
    """True once the server has closed the connection (whatever it sent before)."""
    try:
        while sock.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return True


def _post(url: str, raw: bytes, token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/v1/completions", raw, headers),
                                    timeout=HANG_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


# ---------------------------------------------------------------- 38.2 bodies
def test_a_chunked_body_is_refused_once_it_passes_the_limit_not_when_it_ends(server):
    sock = _connect(server)
    sock.sendall(_head("/v1/completions", {"Content-Type": "application/json",
                                            "Transfer-Encoding": "chunked"}))
    piece = b" " * 16384
    for _ in range(LIMIT // len(piece) + 2):  # past the limit; the body's end never sent
        sock.sendall(_chunk(piece))
    status, body = _response(sock)
    assert status == 413 and "server.limits.max_message_bytes (262144)" in body["error"]["message"]
    assert _closed(sock)  # the rest of that body is never read


@pytest.mark.parametrize("chunked", [True, False])
def test_a_client_still_sending_when_refused_reads_the_413(server, chunked):
    """The server half-closes and discards the rest for a moment (a lingering close) instead of
    closing with unread bytes: a client that sends its whole body before it reads (most do)
    neither fails its writes nor loses the answer to a reset."""
    n = 16 * LIMIT // 65536  # well past the limit, unaware of the 413
    sock = _connect(server)
    framing = {"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": str(n * 65536)}
    sock.sendall(_head("/v1/completions", {"Content-Type": "application/json", **framing}))
    for _ in range(n):
        sock.sendall(_chunk(b" " * 65536) if chunked else b" " * 65536)
    if chunked:
        sock.sendall(b"0\r\n\r\n")
    status, body = _response(sock)
    assert status == 413, body


def test_token_id_zero_is_a_prompt_like_any_other(server):
    status, body = _post(server.url, json.dumps({"model": MODEL, "prompt": [0, 65, 0], "max_tokens": 1}).encode())
    assert status == 200, body


def test_health_answers_while_a_body_streams_in_and_the_body_is_then_served(server):
    sock = _connect(server)
    sock.sendall(_head("/v1/completions", {"Content-Type": "application/json",
                                            "Transfer-Encoding": "chunked"}))
    sock.sendall(_chunk(json.dumps({"model": MODEL, "max_tokens": 2, "prompt": "x" * 100})[:-1].encode()))
    with urllib.request.urlopen(f"{server.url}/health", timeout=HANG_S) as r:
        assert json.loads(r.read()) == {"status": "ok"}
    sock.sendall(_chunk(b"}") + b"0\r\n\r\n")
    status, body = _response(sock)
    assert status == 200 and body["usage"]["completion_tokens"] == 2


# ---------------------------------------------------------------- 38.5 400s naming the field
@pytest.mark.parametrize("field, value, param", [
    ("max_tokens", 2**63, "max_tokens"),
    ("max_tokens", 10**30, "max_tokens"),
    ("priority", 2**70, "priority"),
    ("prompt", [7, 2**40], "prompt[1]"),
    ("prompt", [[7], [8, 2**40]], "prompt[1][1]"),
    ("stop_token_ids", [2**40], "stop_token_ids[0]"),
])
def test_an_out_of_range_number_is_a_400_naming_its_field_and_limit(server, field, value, param):
    body = {"model": MODEL, "prompt": "x", "max_tokens": 1, field: value}
    status, got = _post(server.url, json.dumps(body).encode())
    error = got["error"]
    assert status == 400 and error["param"] == param and "2147483647" in error["message"], error
    assert error["message"].startswith(f"{param}: ")


@pytest.mark.parametrize("depth", [2000, 100_000])
def test_deep_nesting_is_a_400_saying_so(server, depth):
    status, got = _post(server.url, b'{"model": ' + b"[" * depth + b"]" * depth + b"}")
    assert status == 400 and got["error"]["message"] == "body: JSON nesting deeper than 200 levels"


def test_invalid_utf8_is_a_400_naming_the_byte(server):
    raw = b'{"model": "x", "prompt": "\xff"}'
    status, got = _post(server.url, raw)
    assert status == 400 and got["error"]["message"] == f"body: invalid UTF-8 at byte {raw.index(0xff)}"


# ---------------------------------------------------------------- 38.6 auth first
@pytest.mark.parametrize("path", ["/docs", "/openapi.json", "/redoc", "/nope", "/v1/models/x"])
def test_with_a_token_every_path_needs_it_before_it_is_routed(guarded, path):
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(f"{guarded.url}{path}", timeout=HANG_S)
    assert e.value.code == 401 and e.value.headers["WWW-Authenticate"] == "Bearer"
    authorized = urllib.request.Request(f"{guarded.url}{path}", headers={"Authorization": f"Bearer {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as e:  # docs are off; the rest is unknown
        urllib.request.urlopen(authorized, timeout=HANG_S)
    assert e.value.code == 404


def test_an_unauthenticated_body_is_never_read(guarded):
    assert _post(guarded.url, b"{not json")[0] == 401
    assert _post(guarded.url, b"{not json", TOKEN)[0] == 400
    sock = _connect(guarded)
    sock.sendall(_head("/v1/completions", {"Transfer-Encoding": "chunked"}) + _chunk(b"x" * 1024))
    status, body = _response(sock)  # the rest (20 MB, say) is never awaited
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert _closed(sock)


# ---------------------------------------------------------------- 38.7 slow sockets, fan-out
def _trickled_until_closed(sock: socket.socket, data: bytes) -> bool:
    """Send `data` a byte every 0.1 s; True if the server closed the socket before the end."""
    for i in range(len(data)):
        try:
            sock.sendall(data[i:i + 1])
        except (BrokenPipeError, ConnectionResetError):
            return True
        time.sleep(0.1)
    return False


def test_a_slow_header_socket_is_closed(server):
    sock = _connect(server)
    head = _head("/v1/completions", {"Content-Type": "application/json", "X-Pad": "p" * 400})
    assert _trickled_until_closed(sock, head)


def test_a_slow_body_socket_is_closed(server):
    sock = _connect(server)
    sock.sendall(_head("/v1/completions", {"Content-Length": "1000"}) + b'{"model": ')
    assert _closed(sock)


def test_an_idle_socket_is_closed(server):
    assert _closed(_connect(server))


def test_prompts_times_n_is_bounded_per_request(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=["a", "b"], n=2, max_tokens=1)
    assert e.value.body["param"] == "n"
    assert "2 prompt(s) × n 2 = 4 choices, more than server.limits.max_choices (3)" in e.value.message
    assert len(client.completions.create(model=MODEL, prompt=["a", "b", "c"], max_tokens=1).choices) == 3


def test_the_pending_limit_counts_engine_requests(colocated_router, colocated_worker):
    with http_serving(colocated_router, max_pending_requests=4) as s:
        _pending_limit(openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0),
                       colocated_worker)


def _pending_limit(client: openai.OpenAI, worker) -> None:
    with pytest.raises(openai.BadRequestError) as e:  # could never be admitted: no 429 for it
        client.completions.create(model=MODEL, prompt=["a", "b"], n=3, max_tokens=1)
    assert "6 choices, more than server.max_pending_requests (4)" in e.value.message
    stream = client.completions.create(model=MODEL, prompt=["hold", "on"], n=2, max_tokens=400,
                                       stream=True, extra_body={"ignore_eos": True})
    chunks: Iterator = iter(stream)
    next(chunks)  # 4 engine requests open: server.max_pending_requests (4) is reached
    with pytest.raises(openai.RateLimitError) as e:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1)
    assert "max_pending_requests (4)" in e.value.message
    assert e.value.response.headers["retry-after"] == "1"
    stream.close()
    wait_idle([worker])  # its 4 aborted (the server counted them out before the aborts)
    assert client.completions.create(model=MODEL, prompt="x", max_tokens=1).choices


@pytest.mark.parametrize("prompt", [[0, 7], [[0], [3, 0]], "0"])
def test_token_id_zero_is_a_prompt(prompt):
    """Token id 0 is a token, not an empty prompt (README's `bench serve` draws ids below 256)."""
    from loopserve.entrypoints.openai.protocol import CompletionRequest

    assert CompletionRequest(model="m", prompt=prompt).prompt == prompt


@pytest.mark.parametrize("prompt", [[], "", [[]], [""], [[1], []], ["a", ""]])
def test_an_empty_prompt_is_refused(prompt):
    from pydantic import ValidationError

    from loopserve.entrypoints.openai.protocol import CompletionRequest

    with pytest.raises(ValidationError, match="must not be empty"):
        CompletionRequest(model="m", prompt=prompt)
