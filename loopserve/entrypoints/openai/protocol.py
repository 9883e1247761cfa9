"""OpenAI API request and response bodies (pydantic), and their mapping onto SamplingParams.

Requests forbid unknown fields: a misspelled loop parameter (`max_loop`) or an OpenAI option
loopserve does not implement (`echo`, `presence_penalty`, `tools`) is a 400 naming the field,
never silently ignored. Types and shapes are checked here; the limits of values are
SamplingParams' own (one place), and its ValueError names the field too.

Defaults follow OpenAI's (temperature 1, top_p 1, n 1), except `max_tokens`: 16 for chat as
for completions, since the engine reserves KV for max_tokens at admission and OpenAI's chat
default (the rest of the context) would reserve the whole context for every request.
"""

from __future__ import annotations

import time
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from loopserve.engine.sampling_params import SamplingParams

DEFAULT_MAX_TOKENS = 16
MAX_N = 128  # choices per request: each is a request on the engines


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    """Fields both endpoints share; the loop parameters and vLLM's extras are extra body fields."""

    model: str
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    user: str | None = None
    priority: int = 0  # lower = more important
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None

    def sampling_params(self, index: int, logprobs: int | None, max_tokens: int | None) -> SamplingParams:
        """Choice `index`'s params: with a seed, choice i samples with seed + i (n distinct
        samples, reproducible). ValueError names the field that is out of its limits."""
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
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # the sampled token's logprob plus this many top ones

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, p: str | list) -> str | list:
        if not p or any(not x for x in p if isinstance(x, (str, list))):
            raise ValueError("must not be empty")
        return p

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
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None  # newer clients' name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None

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
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
