"""uvicorn's h11 protocol with deadlines for slow clients.

uvicorn closes a connection idle between requests after `timeout_keep_alive`, but a client
that sends its headers or its body a byte at a time keeps its socket (and its buffers) for
ever. Here a request's headers must be complete within `header_s` of the connection being
ready for them (opened, or its previous response sent), and its body within `body_s` of its
headers; else the connection is closed. A response sent before its request's body was read
whole (401, 413, 404) closes the connection too: the rest of that body is never parsed, only
discarded for `linger_s` after a half-close (a close with unread bytes sends a reset, which can
destroy the answer before the client has read it: RFC 9112 section 9.6's lingering close).
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


class _LingeringTransport:
    """The connection's transport as uvicorn sees it: a close while the request's body is still
    arriving (h11 makes uvicorn close after an early answer) lingers instead."""

    def __init__(self, transport: asyncio.Transport, protocol: BoundedH11Protocol) -> None:
        self._transport, self._protocol, self._closing = transport, protocol, False

    def __getattr__(self, name: str):
        return getattr(self._transport, name)

    def is_closing(self) -> bool:
        return self._closing or self._transport.is_closing()

    def close(self) -> None:
        self._closing = True
        if self._protocol.conn.their_state is h11.SEND_BODY:
            self._protocol._linger()
        else:
            self._transport.close()


class BoundedH11Protocol(H11Protocol):
    header_s = 10.0
    body_s = 30.0
    linger_s = 2.0

    @classmethod
    def with_deadlines(cls, header_s: float, body_s: float) -> type[BoundedH11Protocol]:
        """The protocol class uvicorn instantiates per connection, with these deadlines."""
        return type(cls.__name__, (cls,), {"header_s": header_s, "body_s": body_s})

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._lingering = False
        self._raw = transport
        super().connection_made(_LingeringTransport(transport, self))  # type: ignore[arg-type]
        self._arm(self.header_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if not self._lingering:  # else the rest of an answered request's body: dropped
            super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        state = self.conn.their_state
        if state is h11.SEND_BODY:
            if self.cycle is not cycle:  # a new request's headers: its body is due now
                self._arm(self.body_s)
        elif state is not h11.IDLE:  # the request arrived whole
            self._disarm()

    def on_response_complete(self) -> None:
        if self.conn.their_state is h11.SEND_BODY:  # answered before its body was read
            self._linger()
        else:
            self._arm(self.header_s)  # before uvicorn reads a pipelined request's headers
        super().on_response_complete()

    def _linger(self) -> None:
        if self._lingering or self._raw.is_closing():
            return
        self._lingering = True
        if self._raw.can_write_eof():
            self._raw.write_eof()  # the answer, then FIN: the client reads it whole
        self._raw.resume_reading()
        self._arm(self.linger_s)

    def _arm(self, seconds: float) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._close)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _close(self) -> None:
        self._disarm()
        if not self._raw.is_closing():
            self._raw.close()  # connection_lost tells a running request it disconnected
