"""The OpenAI-compatible HTTP server (FastAPI on uvicorn) over a Router, beside the gRPC server.

Routes: POST /v1/completions and /v1/chat/completions (SSE with `"stream": true`), GET
/v1/models, /health, /metrics (Prometheus). It shares the gRPC server's ServerConfig: host
(127.0.0.1 by default), TLS files, request limits, max_pending_requests (counted apart: each
front admits that many) and the bearer token, which every route then needs (401 without it,
as every RPC is UNAUTHENTICATED without it). Errors are OpenAI error objects naming the field:
400 bad input, 404 unknown model, 413 body over server.limits.max_message_bytes, 429
backpressure, 503 no healthy worker of a needed role, 500 an engine failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
import ssl
import time
from collections.abc import Iterator

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.exceptions import HTTPException

from loopserve.cluster.auth import bearer
from loopserve.cluster.config import ServerConfig
from loopserve.cluster.router import Router
from loopserve.engine.config import EngineConfig
from loopserve.entrypoints.openai.chat_template import load_chat_template
from loopserve.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest,
                                                   ModelCard, ModelList)
from loopserve.entrypoints.openai.serving import APIError, OpenAIServing
from loopserve.model.tokenizer import load_tokenizer, tokenizer_file

log = logging.getLogger(__name__)
STATUS_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error"}


def _json(body: BaseModel, status: int = 200) -> JSONResponse:
    return JSONResponse(body.model_dump(mode="json"), status_code=status)


def _error(e: APIError) -> JSONResponse:
    headers = {"WWW-Authenticate": "Bearer"} if e.status == 401 else None
    return JSONResponse(e.body().model_dump(), status_code=e.status, headers=headers)


def _validation_error(e: RequestValidationError) -> APIError:
    """pydantic's first error as one line naming the field (`messages[0].role: ...`)."""
    err = e.errors()[0]
    loc = [x for x in err["loc"] if x != "body"]
    param = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or None
    msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
    if err["type"] == "json_invalid":
        param, msg = None, f"request body is not valid JSON: {err.get('ctx', {}).get('error', msg)}"
    return APIError(400, f"{param}: {msg}" if param else msg, "invalid_request_error", param)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body was read already: only disconnects arrive)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def build_app(router: Router, config: ServerConfig, engine: EngineConfig) -> FastAPI:
    path = tokenizer_file(engine.tokenizer, engine.model)  # the engines' own tokenizer
    tokenizer = load_tokenizer(path)
    serving = OpenAIServing(router, engine.model, tokenizer, load_chat_template(path),
                            config.limits, config.max_pending_requests)
    token = config.auth_token
    expected = bearer(token.get_secret_value()).encode() if token else None
    created = int(time.time())

    async def admit(request: Request) -> None:
        if expected is not None:
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                raise APIError(401, "missing or wrong bearer token (send 'Authorization: Bearer "
                               "<token>')", "authentication_error")
        size = request.headers.get("content-length")
        if size and size.isdigit() and int(size) > config.limits.max_message_bytes:
            raise APIError(413, f"request body has {size} bytes, more than "
                           f"server.limits.max_message_bytes ({config.limits.max_message_bytes})",
                           "invalid_request_error")

    app = FastAPI(title="loopserve", dependencies=[Depends(admit)])
    app.add_exception_handler(APIError, lambda _, e: _error(e))
    app.add_exception_handler(RequestValidationError, lambda _, e: _error(_validation_error(e)))
    app.add_exception_handler(HTTPException, lambda _, e: _error(APIError(
        e.status_code, str(e.detail), STATUS_TYPES.get(e.status_code, "invalid_request_error"))))

    def respond(result) -> Response:
        if isinstance(result, BaseModel):
            return _json(result)
        return StreamingResponse(result, media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return respond(await serving.completion(body, lambda: _disconnected(request)))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return respond(await serving.chat(body, lambda: _disconnected(request)))

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(ModelList(data=[ModelCard(id=engine.model, created=created,
                                               max_model_len=engine.max_model_len)]))

    @app.get("/health")
    async def health() -> Response:
        ok, status = router.serving()  # the router's own view: answers at once
        if not ok:
            raise APIError(503, status, "service_unavailable")
        return JSONResponse({"status": "ok" if status == "SERVING" else status})

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
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=grace, **_tls(self.config))
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
