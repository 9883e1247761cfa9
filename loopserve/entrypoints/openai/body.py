"""A request body: read within a size limit while it streams in, then parsed into its model.

The limit holds whatever the framing: a declared Content-Length over it is refused before a
byte is read, a chunked body as soon as the bytes read pass it (413 at once, the rest never
read; the connection is closed, `sockets.py`). So what is parsed is at most the limit
(server.limits.max_message_bytes, 4 MiB), and parsing it (pydantic-core's JSON parser, straight
into the model) is cheap enough for the event loop: a parser in a thread would hold the GIL
all the same.
"""

from __future__ import annotations

from typing import TypeVar

from pydantic import BaseModel, ValidationError
from starlette.requests import Request

from loopserve.entrypoints.openai.errors import APIError, validation_error

M = TypeVar("M", bound=BaseModel)


def _too_large(size: str, limit: int) -> APIError:
    return APIError(413, f"request body has {size} bytes, more than "
                    f"server.limits.max_message_bytes ({limit})", "invalid_request_error",
                    code="request_too_large")


async def read_body(request: Request, limit: int) -> bytes:
    """The whole body, or APIError 413 once it passes `limit` bytes (starlette's
    ClientDisconnect if the client goes away first)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(declared, limit)
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise _too_large(f"more than {limit}", limit)
    return bytes(body)


def parse_body(raw: bytes, model: type[M]) -> M:
    """`raw` as `model`, or APIError 400 naming the field (or where the body is broken)."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise APIError.invalid(f"body: invalid UTF-8 at byte {e.start}") from None
    try:
        return model.model_validate_json(raw)
    except ValidationError as e:
        raise validation_error(e) from None


async def read_request(request: Request, model: type[M], limit: int) -> M:
    return parse_body(await read_body(request, limit), model)

