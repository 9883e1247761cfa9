"""What the engine streams to callers: one RequestOutput per request per step with news."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    new_token_ids: tuple[int, ...]
    text_delta: str
    exit_depths: tuple[int, ...]  # loop depth each new token's position exited at
    logprobs: tuple[float, ...] | None = None
    top_logprobs: tuple[tuple[tuple[int, float], ...], ...] | None = None
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    error_code: str | None = None  # a gRPC status code name for `error`; None: INTERNAL
    arrival_time: float = 0.0
    first_token_time: float | None = None
    token_times: tuple[float, ...] = ()
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prompt_token_ids: tuple[int, ...] | None = None  # on a request's first output only

    @classmethod
    def ended(cls, request_id: str, reason: str, error: str | None = None,
              code: str | None = None) -> RequestOutput:
        """The last output of a request that ends outside a step (aborted, failed, lost its
        worker): no news, just the end and why (`code`: UNAVAILABLE when no worker is left)."""
        return cls(request_id, (), "", (), finished=True, finish_reason=reason, error=error,
                   error_code=code)


@dataclass
class CompletionOutput:
    """A finished request, accumulated from its stream (what LLM.generate returns)."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    exit_depths: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    error: str | None = None
    arrival_time: float = 0.0
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    def add(self, out: RequestOutput) -> None:
        self.token_ids.extend(out.new_token_ids)
        self.text += out.text_delta
        self.exit_depths.extend(out.exit_depths)
        self.token_times.extend(out.token_times)
        if out.logprobs is not None:
            self.logprobs = (self.logprobs or []) + list(out.logprobs)
        if self.first_token_time is None:
            self.first_token_time = out.first_token_time
        self.arrival_time = out.arrival_time
        if out.finished:
            self.finish_reason, self.error = out.finish_reason, out.error
