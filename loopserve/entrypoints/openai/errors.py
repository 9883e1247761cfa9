"""OpenAI error objects and the HTTP status of every error, by the table of `protocol/status.py`.

`error.code` is a string (the error's code, lower case: `invalid_argument`, `unavailable`,
...) or null, as OpenAI's spec has it; `param` names the request field at fault.
"""

from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

from loopserve.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from loopserve.protocol.status import RETRY_AFTER_S, STATUS, Code, FieldError, code_of

# The JSON parser's nesting limit (pydantic-core's: deeper documents are refused by it).
JSON_MAX_DEPTH = 200
# Type tags pydantic puts in an error's location for the members of a union.
_TAGS = {"str", "int", "float", "bool", "list", "dict"}


class APIError(Exception):
    """An OpenAI error object with its HTTP status."""

    def __init__(self, status: int, message: str, type_: str, param: str | None = None,
                 code: str | None = None, retry: bool = False) -> None:
        super().__init__(message)
        self.status, self.type, self.param, self.code, self.retry = status, type_, param, code, retry

    @classmethod
    def of(cls, code: Code, message: str, param: str | None = None) -> APIError:
        s = STATUS[code]
        return cls(s.http, message, s.type, param, code.value.lower(), s.retry)

    @classmethod
    def invalid(cls, message: str, param: str | None = None) -> APIError:
        return cls.of(Code.INVALID_ARGUMENT, f"{param}: {message}" if param else message, param)

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=str(self), type=self.type, param=self.param,
                                             code=self.code))

    def response(self) -> JSONResponse:
        headers = {}
        if self.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if self.retry:
            headers["Retry-After"] = str(RETRY_AFTER_S)
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=headers)


def _param(field: str, fields: set[str], renames: dict[str, str]) -> str | None:
    """The request field a FieldError names ("sampling.stop[0]", "prompt.text", "top_p") as
    the endpoint spells it."""
    word = field.removeprefix("sampling.").split("[")[0].split(".")[0]
    word = renames.get(word, word)
    return word if word in fields else None


def refusal(e: Exception, fields: set[str], renames: dict[str, str]) -> APIError | None:
    """A router, engine or request error as its status (None: not one of them, a bug); a
    FieldError's field is the error object's `param` (no message is read for one)."""
    code = code_of(e)
    if code is None:
        return None
    param = _param(e.field, fields, renames) if isinstance(e, FieldError) else None
    return APIError.of(code, str(e), param)


def validation_error(e: ValidationError) -> APIError:
    """pydantic's error as one line naming the field (`messages[0].role: ...`): of a union's
    members' errors, the one that got furthest into the value (`prompt[3]` over `prompt`)."""
    errors = e.errors()
    err = max(errors, key=lambda x: len(x["loc"]))
    if err["type"] == "json_invalid":
        why = err["msg"].removeprefix("Invalid JSON: ")
        if why.startswith("recursion limit exceeded"):
            return APIError.invalid(f"body: JSON nesting deeper than {JSON_MAX_DEPTH} levels")
        return APIError.invalid(f"body is not valid JSON: {why}")
    loc = [x for x in err["loc"] if isinstance(x, int) or not (x in _TAGS or "[" in x)]
    param = "".join(f"[{x}]" if isinstance(x, int) else f".{x}" for x in loc).lstrip(".") or None
    msg = "unknown field" if err["type"] == "extra_forbidden" else err["msg"]
    return APIError.invalid(msg.removeprefix("Value error, "), param)
