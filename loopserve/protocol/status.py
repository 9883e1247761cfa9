"""Error codes, the errors that carry them, and what each front answers for them: one table
for gRPC and HTTP.

Every error a request can meet has a code, a gRPC status code name, set where the error
arises: a refusal before the first output by its exception's type (`code_of`), an in-band
error by `RequestOutput.error_code` (the router: UNAVAILABLE for a lost worker or no healthy
one, or the code of the failure it gave up migrating; a decode worker: UNAVAILABLE for a KV
read that failed; an engine fault: none, that is INTERNAL). The gRPC front answers the
status code named `Code.value`, the HTTP front `Status.http` (with Retry-After when `retry`).
A bad request field is a `FieldError` that names the field; nothing parses messages for a
code.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

RETRY_AFTER_S = 1  # what HTTP's Retry-After says for a transient refusal


class Code(str, Enum):
    """gRPC status code names (the gRPC front answers `grpc.StatusCode[code.value]`)."""

    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


@dataclass(frozen=True)
class Status:
    http: int
    type: str  # the OpenAI error object's `type`
    retry: bool  # transient: a client may retry the same request


STATUS: dict[Code, Status] = {
    Code.INVALID_ARGUMENT: Status(400, "invalid_request_error", False),
    Code.ALREADY_EXISTS: Status(409, "invalid_request_error", False),
    Code.RESOURCE_EXHAUSTED: Status(429, "rate_limit_error", True),
    Code.UNAVAILABLE: Status(503, "service_unavailable", True),
    Code.INTERNAL: Status(500, "server_error", False),
}


class FieldError(ValueError):
    """Bad input in one request field (`field`, as the gRPC request spells it: `prompt.text`,
    `sampling.stop[0]`); INVALID_ARGUMENT."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field} {message}")
        self.field = field
        self._message = message

    def __reduce__(self) -> tuple:
        """Pickled with both arguments: a worker's refusal crosses Ray and the process launcher."""
        return type(self), (self.field, self._message)


class QueueFullError(RuntimeError):
    """Backpressure: the waiting queue holds max_waiting requests; retry later or elsewhere
    (RESOURCE_EXHAUSTED)."""


class NoWorkerError(RuntimeError):
    """No healthy worker of the needed role (UNAVAILABLE)."""


class RequestIdInUseError(ValueError):
    """A live request already has this client id (ALREADY_EXISTS)."""


class RequestFailed(RuntimeError):
    """A request that ended in an error once accepted, with the code its output carried."""

    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(message)
        self.code = Code(code) if code else Code.INTERNAL


# First match wins: an id in use is a ValueError too.
_REFUSALS: tuple[tuple[type[Exception], Code], ...] = (
    (RequestIdInUseError, Code.ALREADY_EXISTS), (ValueError, Code.INVALID_ARGUMENT),
    (QueueFullError, Code.RESOURCE_EXHAUSTED), (NoWorkerError, Code.UNAVAILABLE))


def code_of(e: Exception) -> Code | None:
    """The code of a refusal (None: not one of the refusals, i.e. a bug to propagate)."""
    if isinstance(e, RequestFailed):
        return e.code
    return next((code for kind, code in _REFUSALS if isinstance(e, kind)), None)
