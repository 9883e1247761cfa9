"""The gRPC server (grpc.aio): LoopServe over a Router, plus the standard grpc.health.v1 and
server reflection (grpcurl lists and describes the services; the token guards it too).

Generate streams the first token as soon as the prefill side has it, then the decode side's
tokens. A cancelled stream aborts the request on every engine holding it (the router's
stream is closed with it). LoopServe's methods take raw request bytes and parse them here,
so a malformed message is INVALID_ARGUMENT naming the problem (grpc's own deserializer
answers INTERNAL). Bad input gets INVALID_ARGUMENT naming the field and its limit, a live
request's id ALREADY_EXISTS, a full server (max_pending_requests streams) or engine queue
RESOURCE_EXHAUSTED, no healthy worker UNAVAILABLE (up front, or in-band once streaming): the
codes of `status.py`, the table the HTTP server answers by too.
Health answers from the router's own view at once: SERVING, DEGRADED (some worker is down
or unresponsive, every role still served) or UNAVAILABLE; grpc.health.v1 says SERVING for
the first two.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict

import grpc
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection

from loopserve.cluster.config import ServerConfig
from loopserve.cluster.router.core import Router
from loopserve.entrypoints.auth import BearerTokenInterceptor
from loopserve.entrypoints.grpc.proto import loopserve_pb2 as pb
from loopserve.entrypoints.grpc.protocol import parse, request_from_proto, responses_from_output
from loopserve.protocol.limits import check_limits
from loopserve.protocol.stats import WorkerStats
from loopserve.protocol.status import code_of

log = logging.getLogger(__name__)
SERVICE = "loopserve.v1.LoopServe"
HEALTH_PERIOD_S = 2.0


class LoopServeServicer:
    def __init__(self, router: Router, config: ServerConfig) -> None:
        self.router = router
        self.config = config
        self.in_flight = 0  # Generate streams open (one event loop: no lock needed)

    async def Generate(self, raw: bytes, context: grpc.aio.ServicerContext):
        limit = self.config.max_pending_requests
        if self.in_flight >= limit:  # before parsing: an overloaded server does no work for it
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.in_flight} Generate streams in flight, the most "
                                f"server.max_pending_requests ({limit}) allows; retry later")
        self.in_flight += 1
        stream = None
        try:
            request = parse(pb.GenerateRequest, raw)
            prompt, params = request_from_proto(request)
            check_limits(request.request_id, prompt, params, self.config.limits)
            stream = self.router.generate(prompt, params, request.request_id or None)
            async for out in stream:
                for msg in responses_from_output(out, out.request_id, time.time()):
                    yield msg
        except Exception as e:  # a refusal is raised before the first output: no stream yet
            if (code := code_of(e)) is None:
                raise
            await context.abort(grpc.StatusCode[code.value], str(e))
        finally:
            self.in_flight -= 1
            if stream is not None:
                await stream.aclose()  # not finished: aborts the request on both engines

    async def Abort(self, request: pb.AbortRequest, context) -> pb.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id must be set")
        return pb.AbortResponse(aborted=await self.router.abort(request.request_id))

    async def Health(self, request: pb.HealthRequest, context) -> pb.HealthResponse:
        ok, status = self.router.serving()  # the router's own view: answers at once
        return pb.HealthResponse(healthy=ok, status=status)

    async def GetStats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        stats = await self.router.stats_async()  # within the deadline of this call, no thread
        return pb.StatsResponse(workers=[_worker_stats(w, s) for w, s in stats.items()])


def _parsing(method: Callable[[Message, grpc.aio.ServicerContext], Awaitable[Message]],
             request_cls: type[Message]) -> Callable[[bytes, grpc.aio.ServicerContext], Awaitable[Message]]:
    """A unary method over raw bytes: parsed here, so garbage is INVALID_ARGUMENT."""
    async def call(raw: bytes, context: grpc.aio.ServicerContext) -> Message:
        try:
            request = parse(request_cls, raw)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return await method(request, context)
    return call


def _handlers(servicer: LoopServeServicer) -> grpc.GenericRpcHandler:
    """LoopServe's methods, registered without request deserializers (they get raw bytes)."""
    unary = {"Abort": (pb.AbortRequest, pb.AbortResponse), "Health": (pb.HealthRequest, pb.HealthResponse),
             "GetStats": (pb.StatsRequest, pb.StatsResponse)}
    methods = {name: grpc.unary_unary_rpc_method_handler(
        _parsing(getattr(servicer, name), req), response_serializer=resp.SerializeToString)
        for name, (req, resp) in unary.items()}
    methods["Generate"] = grpc.unary_stream_rpc_method_handler(
        servicer.Generate, response_serializer=pb.GenerateResponse.SerializeToString)
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def _worker_stats(worker_id: str, s: WorkerStats) -> pb.WorkerStats:
    if (e := s.engine) is None:  # the worker did not answer
        return pb.WorkerStats(worker_id=worker_id, healthy=False)
    counters = {k: int(v) for k, v in asdict(e.counters).items() if isinstance(v, (int, float))}
    counters.update({f"batches_{k}": v for k, v in e.counters.batches.items()})
    if s.decode is not None:
        counters.update({f"kv_reads_{k}": int(v) for k, v in asdict(s.decode.kv_reads).items()
                         if not k.endswith("seconds")})
    counters.update({f"prefix_cache_{k}": v for k, v in asdict(e.prefix_cache).items()})
    pools = {name: pb.PoolUsage(**asdict(u)) for name, u in e.pools().items()}
    sched = e.scheduler
    return pb.WorkerStats(
        worker_id=worker_id, role=s.role, looped=pools["looped"], flat=pools["flat"],
        num_waiting=sched.num_waiting, num_running=sched.num_running,
        num_receiving=sched.num_receiving, num_transferring=sched.num_transferring,
        counters=counters, healthy=s.healthy,
        pool_accounting_ok=all(u.free + u.used == u.total for u in e.pools().values()))


def _tls(config: ServerConfig) -> grpc.ServerCredentials:
    """TLS from PEM files; with a client CA, clients must present a certificate it signed."""
    ca = config.tls_client_ca_file.read_bytes() if config.tls_client_ca_file else None
    return grpc.ssl_server_credentials(
        [(config.tls_key_file.read_bytes(), config.tls_cert_file.read_bytes())],
        root_certificates=ca, require_client_auth=ca is not None)


class Server:
    """The gRPC server over a router; `port` is the bound one after start() (useful with port 0)."""

    def __init__(self, router: Router, config: ServerConfig | None = None) -> None:
        self.router = router
        self.config = config or ServerConfig()
        self.host = self.config.host
        self.port = self.config.port
        self._server: grpc.aio.Server | None = None
        self.health: health_aio.HealthServicer | None = None
        self._health_task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    async def start(self) -> Server:
        """Bind and start (inside the event loop that will serve: grpc.aio binds to it)."""
        token = self.config.auth_token
        self._server = grpc.aio.server(
            interceptors=[BearerTokenInterceptor(token.get_secret_value())] if token else [],
            # so_reuseport 0: a second server on a bound port fails here (grpc's default lets
            # both bind and splits the connections between them).
            options=[("grpc.max_receive_message_length", self.config.limits.max_message_bytes),
                     ("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers((_handlers(LoopServeServicer(self.router, self.config)),))
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        # Reflection, so grpcurl and other generic clients can list and call the services.
        reflection.enable_server_reflection(
            (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), self._server)
        try:
            if self.config.tls:
                bound = self._server.add_secure_port(f"{self.host}:{self.port}", _tls(self.config))
            else:
                bound = self._server.add_insecure_port(f"{self.host}:{self.port}")
        except RuntimeError as e:  # grpc's "Failed to bind"
            raise OSError(f"cannot bind the gRPC server to {self.host}:{self.port} (in use?): {e}") from None
        if bound == 0:
            raise OSError(f"cannot bind the gRPC server to {self.host}:{self.port} (in use?)")
        self.port = bound
        await self._server.start()
        await self._update_health()
        self._health_task = asyncio.create_task(self._watch_health())
        log.info("loopserve gRPC server on %s (%s, %s)", self.address,
                 "TLS" if self.config.tls else "plaintext", "token" if token else "no auth")
        if token is None and self.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("serving on %s without server.auth_token: anyone who reaches it can "
                        "generate", self.host)
        return self

    async def _update_health(self) -> None:
        ok, _ = self.router.serving()
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            await self.health.set(name, status)

    async def _watch_health(self) -> None:
        while True:
            await asyncio.sleep(HEALTH_PERIOD_S)
            try:
                await self._update_health()
            except Exception as e:  # noqa: BLE001 - keep watching; the next round may succeed
                log.warning("health check failed: %s", e)

    async def stop(self, grace: float = 2.0) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)
