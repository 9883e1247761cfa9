"""A small blocking gRPC client for `loopserve serve` (used by `loopserve client` and tests)."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loopserve.entrypoints.auth import BearerToken
from loopserve.entrypoints.grpc.proto import loopserve_pb2 as pb
from loopserve.entrypoints.grpc.proto import loopserve_pb2_grpc as pb_grpc
from loopserve.entrypoints.grpc.protocol import StreamEvent, event_from_response, request_to_proto
from loopserve.protocol.sampling_params import SamplingParams


class LoopServeClient:
    """`token`: sent as `authorization: Bearer <token>` on every call. TLS when `tls` is set
    or any PEM is given: `root_certificates` to trust (default: the system's), and
    `private_key` + `certificate_chain` for servers that require client certificates."""

    def __init__(self, address: str = "127.0.0.1:50051", token: str | None = None,
                 tls: bool = False, root_certificates: bytes | None = None,
                 private_key: bytes | None = None, certificate_chain: bytes | None = None) -> None:
        self.address = address
        if tls or root_certificates or certificate_chain:
            creds = grpc.ssl_channel_credentials(root_certificates, private_key, certificate_chain)
            self.channel = grpc.secure_channel(address, creds)
        else:
            self.channel = grpc.insecure_channel(address)
        if token:
            self.channel = grpc.intercept_channel(self.channel, BearerToken(token))
        self.stub = pb_grpc.LoopServeStub(self.channel)

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               request_id: str = "", timeout: float | None = None):
        """The raw response stream (cancel() it to abort the request)."""
        req = request_to_proto(prompt, params or SamplingParams(), request_id or "")
        return self.stub.Generate(req, timeout=timeout)

    def generate(self, prompt: str | list[int], params: SamplingParams | None = None,
                 request_id: str | None = None, timeout: float | None = None) -> Iterator[StreamEvent]:
        for r in self.stream(prompt, params, request_id or "", timeout):
            yield event_from_response(r)

    def abort(self, request_id: str) -> bool:
        return self.stub.Abort(pb.AbortRequest(request_id=request_id)).aborted

    def health(self) -> pb.HealthResponse:
        return self.stub.Health(pb.HealthRequest())

    def health_check(self, service: str = "") -> str:
        """The standard grpc.health.v1 status name (SERVING, NOT_SERVING, ...)."""
        stub = health_pb2_grpc.HealthStub(self.channel)
        resp = stub.Check(health_pb2.HealthCheckRequest(service=service))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)

    def stats(self) -> pb.StatsResponse:
        return self.stub.GetStats(pb.StatsRequest())

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> LoopServeClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
