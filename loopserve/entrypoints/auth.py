"""Bearer-token auth on every RPC: a grpc.aio server interceptor and the client's side of it.

The server interceptor runs before any handler (LoopServe's, grpc.health.v1's, any service
added later, unknown methods too), so an unauthenticated caller learns nothing and costs
nothing. Tokens are compared in constant time (`hmac.compare_digest`).
"""

from __future__ import annotations

import hmac
from collections import namedtuple
from collections.abc import Awaitable, Callable, Sequence

import grpc

HEADER = "authorization"
REFUSED = f"missing or wrong bearer token (send metadata '{HEADER}: Bearer <token>')"


def bearer(token: str) -> str:
    return f"Bearer {token}"


async def _refuse(request_or_iterator, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, REFUSED)


# A refusing handler of the same shape as the one asked for (so streaming calls end cleanly).
_SHAPES = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str) -> None:
        self._expected = bearer(token).encode()

    async def intercept_service(
        self, continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if self._authorized(details.invocation_metadata):
            return handler
        shape = (handler.request_streaming, handler.response_streaming) if handler else (False, False)
        return _SHAPES[shape](_refuse)

    def _authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        got = next((v for k, v in metadata or () if k == HEADER), None)
        return isinstance(got, str) and hmac.compare_digest(got.encode(), self._expected)


class _CallDetails(namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials",
                                               "wait_for_ready", "compression")),
                   grpc.ClientCallDetails):
    pass


class BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the token to every call of a channel (plaintext or TLS alike; grpc's own call
    credentials refuse plaintext channels, and a loopback server may well be one)."""

    def __init__(self, token: str) -> None:
        self._header = (HEADER, bearer(token))

    def _with_token(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, (*(d.metadata or ()), self._header),
                            d.credentials, d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._with_token(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._with_token(details), request)
