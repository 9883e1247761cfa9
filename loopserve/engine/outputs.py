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
    arrival_time: float = 0.0
    first_token_time: float | None = None
    token_times: tuple[float, ...] = ()
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    prompt_token_ids: tuple[int, ...] | None = None  # on a request's first output only


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


@dataclass
class EngineCounters:
    tokens_generated: int = 0
    prompt_tokens: int = 0
    loops_run: int = 0  # rows x loops executed in RECURRENT batches
    batches: dict[str, int] = field(default_factory=lambda: {"PRELUDE": 0, "RECURRENT": 0, "CODA": 0})
    preemptions: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
