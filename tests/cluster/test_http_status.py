"""Every error's status from one table (`protocol/status.py`) on both fronts, by the code the
error carries from where it arose (issue 38.3): a worker lost mid-request is a 503 with
Retry-After on HTTP (an SSE error of code `unavailable` once streaming) and UNAVAILABLE on
gRPC; an engine fault is a 500 / INTERNAL. An unauthenticated /health says only the status
(38.6). Each test has its own worker, as it loses or breaks it."""

from __future__ import annotations

import contextlib
import json
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from loopserve.cluster.router.core import Router
from loopserve.protocol.sampling_params import SamplingParams
from tests.cluster.conftest import ENGINE, http_serving, serving, until
from tests.cluster.faulty import FAULT, break_engine
from tests.cluster.inprocess import InProcessHandle

MODEL = ENGINE["model"]
HOLD = {"model": MODEL, "prompt": "hold", "max_tokens": 400, "ignore_eos": True}


class LosableHandle(InProcessHandle):
    """A worker that can be lost as a dead actor is: once `lost`, every call raises."""

    lost = False

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        if self.lost:
            raise ConnectionError(f"worker {self.worker_id} is gone")
        return super()._call(method, *args, timeout=timeout)


@contextlib.contextmanager
def _router(name: str):
    handle = LosableHandle(name, ENGINE)
    router = Router([handle], poll_s=0.1).start()
    try:
        yield handle, router
    finally:
        router.close()
        handle.lost = False
        handle.shutdown()


def _running(handle: LosableHandle) -> None:
    until(lambda: handle.stats().engine.scheduler.num_running == 1, what="the request running")


def _post(url: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, {k.lower(): v for k, v in r.headers.items()}, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {k.lower(): v for k, v in e.headers.items()}, json.loads(e.read())


def _get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {})) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_a_worker_lost_mid_request_is_a_503_with_retry_after_and_health_says_only_the_status():
    with _router("losable") as (handle, router), http_serving(router) as s:
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(_post, s.url, HOLD)
            _running(handle)
            handle.lost = True
            status, headers, body = answer.result()
        assert status == 503 and headers["retry-after"] == "1", body
        error = body["error"]
        assert (error["type"], error["code"]) == ("service_unavailable", "unavailable")
        assert "worker losable" in error["message"] and "no healthy colocated worker" in error["message"]
        # a new request: refused up front, the same status
        status, headers, body = _post(s.url, {**HOLD, "max_tokens": 1})
        assert status == 503 and headers["retry-after"] == "1" and body["error"]["code"] == "unavailable"
        # no token configured: anyone may ask, so the answer is the status alone
        assert _get(f"{s.url}/health") == (503, {"status": "unavailable"})
        with http_serving(router, auth_token="s3cret") as t:
            status, body = _get(f"{t.url}/health", {"Authorization": "Bearer s3cret"})
        assert status == 503 and body["status"] == "unavailable" and "losable" in body["detail"]


def test_a_worker_lost_mid_stream_ends_the_sse_stream_with_an_unavailable_error():
    with _router("losable-sse") as (handle, router), http_serving(router) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="unused", max_retries=0)
        stream = iter(client.completions.create(model=MODEL, prompt="hold", max_tokens=400,
                                                stream=True, extra_body={"ignore_eos": True}))
        next(stream)
        handle.lost = True
        with pytest.raises(openai.APIError) as e:
            for _ in stream:
                pass
        assert (e.value.type, e.value.code) == ("service_unavailable", "unavailable")
        assert "worker losable-sse" in e.value.message


def test_grpc_answers_by_the_same_table_unavailable_for_a_lost_worker_internal_for_a_fault():
    params = SamplingParams(max_tokens=400, ignore_eos=True)
    with _router("losable-grpc") as (handle, router), serving(router) as client:
        with ThreadPoolExecutor(1) as pool:
            events = pool.submit(lambda: list(client.generate("hold", params)))
            _running(handle)
            handle.lost = True
            last = events.result()[-1]
        assert last.kind == "error" and last.error.startswith("UNAVAILABLE: worker losable-grpc")
    with _router("breakable-grpc") as (handle, router), serving(router) as client:
        break_engine(handle.host)
        last = list(client.generate("x", SamplingParams(max_tokens=4)))[-1]
        # the engine's fault, though no other worker could take the request over
        assert last.kind == "error" and last.error.startswith("INTERNAL: ") and FAULT in last.error
