"""The OpenAI-compatible HTTP server (FastAPI on uvicorn) over a Router, beside the gRPC server.

Routes: POST /v1/completions and /v1/chat/completions (SSE with `"stream": true`), GET
/v1/models, /v1/models/{id}, /health, /metrics (Prometheus). It shares the gRPC server's
ServerConfig: host (127.0.0.1 by default), TLS files, request limits, max_pending_requests
(counted apart: each front admits that many engine requests) and the bearer token, which
then comes first on every path (401 before routing, before the body is read), as every RPC
is UNAUTHENTICATED without it. Bodies are read within server.limits.max_message_bytes
whatever their framing (`body.py`); slow sockets are closed (`sockets.py`). Errors are OpenAI
error objects naming the field: 400 bad input, 401, 404 unknown model or path, 413 body too
large, and by the code table of `protocol/status.py`: 429 backpressure and 503 a lost or no
healthy worker (both with Retry-After), 500 an engine fault.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Receive, Scope, Send

from loopserve.cluster.config import ServerConfig
from loopserve.cluster.router.core import Router
from loopserve.engine.config import EngineConfig
from loopserve.entrypoints.auth import bearer
from loopserve.entrypoints.openai.body import read_request
from loopserve.entrypoints.openai.chat_template import load_chat_template
from loopserve.entrypoints.openai.errors import APIError
from loopserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                   ModelCard, ModelList)
from loopserve.entrypoints.openai.serving import OpenAIServing
from loopserve.entrypoints.openai.sockets import BoundedH11Protocol

log = logging.getLogger(__name__)
STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error"}
# h11's bound on a request line plus headers (uvicorn's default): larger ones are a 400.
MAX_HEADER_BYTES = 16 * 1024


def _json(body: BaseModel, status: int = 200) -> JSONResponse:
    return JSONResponse(body.model_dump(mode="json"), status_code=status)


class _Auth:
    """With a token, every request needs it before anything else runs: before routing (an
    unknown path is a 401, not a 404) and before its body is read (a 401, never a 400/413)."""

    def __init__(self, app: ASGIApp, expected: bytes) -> None:
        self.app, self.expected = app, expected

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):
                error = APIError(401, "missing or wrong bearer token (send 'Authorization: Bearer "
                                 "<token>')", "authentication_error", code="invalid_api_key")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already: only disconnects arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(router: Router, config: ServerConfig, engine: EngineConfig) -> FastAPI:
    # The router's tokenizer (the engines' own, loaded once per process) and its template.
    serving = OpenAIServing(router, engine.model, engine.max_model_len, router.tokenizer,
                            load_chat_template(router.limits[0].tokenizer, config.chat_template),
                            config.limits, config.max_pending_requests)
    token = config.auth_token
    limit = config.limits.max_message_bytes
    created = int(time.time())
    card = ModelCard(id=engine.model, created=created, max_model_len=engine.max_model_len)

    # No /docs, /redoc, /openapi.json: the API is OpenAI's (README), and bodies are parsed
    # here within their limit rather than by FastAPI, so its schema would not show them.
    app = FastAPI(title="loopserve", docs_url=None, redoc_url=None, openapi_url=None)
    if token is not None:
        app.add_middleware(_Auth, expected=bearer(token.get_secret_value()).encode())
    app.add_exception_handler(APIError, lambda _, e: e.response())
    app.add_exception_handler(HTTPException, lambda _, e: APIError(
        e.status_code, str(e.detail), STATUS_TYPES.get(e.status_code, "invalid_request_error")).response())

    def respond(result) -> Response:
        if isinstance(result, BaseModel):
            return _json(result)
        return StreamingResponse(result, media_type="text/event-stream")

    async def serve(request: Request, model: type[BaseModel],
                    call: Callable[[BaseModel, Callable[[], Awaitable[None]]], Awaitable]) -> Response:
        try:
            body = await read_request(request, model, limit)
        except ClientDisconnect:  # gone (or too slow: sockets.py closed it); nobody to answer
            return Response(status_code=499)
        return respond(await call(body, lambda: _disconnected(request)))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serve(request, CompletionRequest, serving.completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serve(request, ChatCompletionRequest, serving.chat)

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(ModelList(data=[card]))

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        serving.check_model(model)
        return _json(card)

    @app.get("/health")
    async def health() -> Response:
        ok, status = router.serving()  # the router's own view: answers at once
        word = "ok" if status == "SERVING" else status.split(":", 1)[0].lower()
        # Which worker is down and why (actor ids, pids) only for a caller who sent the token.
        body = {"status": word, **({"detail": status} if token is not None and status != "SERVING" else {})}
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(await router.render_metrics(), media_type=CONTENT_TYPE_LATEST)

    return app


class _Uvicorn(uvicorn.Server):
    """uvicorn in an event loop it shares (with the gRPC server): the process's signal
    handlers stay those of whoever runs the loop."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _tls(config: ServerConfig) -> dict:
    if not config.tls:
        return {}
    ca = config.tls_client_ca_file
    return {"ssl_certfile": str(config.tls_cert_file), "ssl_keyfile": str(config.tls_key_file),
            "ssl_ca_certs": str(ca) if ca else None,
            "ssl_cert_reqs": ssl.CERT_REQUIRED if ca else ssl.CERT_NONE}


class HttpServer:
    """The HTTP front on config.host:config.http_port; `port` is the bound one after start()."""

    def __init__(self, router: Router, config: ServerConfig, engine: EngineConfig) -> None:
        if config.http_port is None:
            raise ValueError("server.http_port is not set")
        self.config = config
        self.host, self.port = config.host, config.http_port
        self.app = build_app(router, config, engine)
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.config.tls else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    async def start(self, grace: float = 2.0) -> HttpServer:
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self.port))
        except OSError as e:
            sock.close()
            raise OSError(f"cannot bind the HTTP server to {self.host}:{self.port}: {e}") from None
        self.port = sock.getsockname()[1]
        c = self.config
        config = uvicorn.Config(
            self.app, log_level="warning", access_log=False, lifespan="off",
            timeout_graceful_shutdown=grace, timeout_keep_alive=c.http_keep_alive_s,
            http=BoundedH11Protocol.with_deadlines(c.http_header_timeout_s, c.http_body_timeout_s),
            h11_max_incomplete_event_size=MAX_HEADER_BYTES, **_tls(c))
        self._server = _Uvicorn(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:  # uvicorn has no started event to await
            if self._task.done():
                self._task.result()  # its startup error
                raise RuntimeError("the HTTP server exited during startup")
            await asyncio.sleep(0.01)
        log.info("loopserve HTTP server on %s", self.url)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task
