"""OpenAI API request and response bodies (pydantic), and their mapping onto SamplingParams.

Requests forbid unknown fields: a misspelled loop parameter (`max_loop`) or an OpenAI option
loopserve does not implement (`tools`) is a 400 naming the field, never silently ignored.
Options clients send by default are accepted at their neutral value (`presence_penalty` and
`frequency_penalty` 0, `logit_bias` empty or null, `echo` false, `best_of` null or n,
`suffix` null) and
refused, naming them, at any value that would change the output. Types, shapes and the
wire's ranges (int32, as the engines' protocol carries them) are checked here; the limits of
values are SamplingParams' own (one place), and its FieldError names the field too.

Defaults follow OpenAI's (temperature 1, top_p 1, n 1), except `max_tokens`: 16 for chat as
for completions, since the engine reserves KV for max_tokens at admission and OpenAI's chat
default (the rest of the context) would reserve the whole context for every request.
"""

from __future__ import annotations

import time
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, FailFast, Field, StrictInt, ValidationInfo, field_validator

from loopserve.protocol.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16
MAX_N = 128  # choices per prompt (server.limits.max_choices bounds prompts × n)
INT32_MAX = 2**31 - 1
Int32 = Annotated[int, Field(ge=-INT32_MAX - 1, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]  # token counts, loop counts
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]  # "1" is text, never id 1


class _FailFast(FailFast):
    """pydantic's FailFast (a list stops at its first bad item: a body of a million bad
    items costs one error, not a million), hashable as a union member must be on Python 3.11."""

    __hash__ = object.__hash__


FAIL_FAST = _FailFast()


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share; the loop parameters and vLLM's extras are extra body fields."""

    model: str
    max_tokens: Count | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Int32 = 0
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | Annotated[list[str], FAIL_FAST] | None = None
    stop_token_ids: Annotated[list[TokenId], FAIL_FAST] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = Field(None, ge=0, lt=2**63)
    user: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict | None = None  # any map is read as is: only an empty one is accepted
    priority: Int32 = 0  # lower = more important
    min_loops: Count | None = None
    max_loops: Count | None = None
    exit_threshold: float | None = None

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float) -> float:
        if v != 0:
            raise ValueError(f"only 0 is supported (loopserve applies no such penalty), got {v}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _no_bias(cls, v: dict | None) -> dict | None:
        if v:
            raise ValueError("only an empty map or null is supported (loopserve applies no logit bias)")
        return v

    def sampling_params(self, index: int, logprobs: int | None, max_tokens: int | None) -> SamplingParams:
        """Choice `index`'s params: with a seed, choice i samples with seed + i (n distinct
        samples, reproducible). FieldError names the field that is out of its limits."""
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=DEFAULT_MAX_TOKENS if max_tokens is None else max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=None if self.seed is None else self.seed + index, stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids), ignore_eos=self.ignore_eos,
            logprobs=logprobs, min_loops=self.min_loops, max_loops=self.max_loops,
            exit_threshold=self.exit_threshold, priority=self.priority)


class CompletionRequest(_Sampling):
    # One text or token-id prompt, or a batch of them (choices are numbered prompt-major).
    # Tried in this order (strict ints): smart-mode unions validate a long list once per member.
    prompt: (str | Annotated[list[TokenId], FAIL_FAST] | Annotated[list[str], FAIL_FAST]
             | Annotated[list[Annotated[list[TokenId], FAIL_FAST]], FAIL_FAST]) = Field(
        union_mode="left_to_right")
    logprobs: Count | None = None  # the sampled token's logprob plus this many top ones
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, p: str | list) -> str | list:
        if not p or (isinstance(p, list) and any(isinstance(x, (str, list)) and not x for x in p)):
            raise ValueError("must not be empty")
        return p

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("only false is supported (loopserve does not echo the prompt)")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("only null or empty is supported (loopserve does not insert text)")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of_is_n(cls, v: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if v is not None and v != n:
            raise ValueError(f"only null or n ({n}) is supported (loopserve returns every "
                             f"sample it draws), got {v}")
        return v

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        return [p] if isinstance(p, str) or isinstance(p[0], int) else list(p)

    def params(self, index: int) -> SamplingParams:
        return self.sampling_params(index, self.logprobs, self.max_tokens)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], FAIL_FAST] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], FAIL_FAST] = Field(min_length=1)
    max_completion_tokens: Count | None = None  # newer clients' name for max_tokens
    logprobs: bool = False
    top_logprobs: Count | None = None

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("needs logprobs: true")
        return v

    def params(self, index: int) -> SamplingParams:
        n_top = (self.top_logprobs or 0) if self.logprobs else None
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        return self.sampling_params(index, n_top, max_tokens)


# ---------------------------------------------------------------------------- responses
class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] | None = None
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    exit_depths: list[int] = Field(default_factory=list)  # loopserve: each token's loop depth


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] = Field(default_factory=list)


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    exit_depths: list[int] = Field(default_factory=list)


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage


class Delta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: Delta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    exit_depths: list[int] = Field(default_factory=list)


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loopserve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
