"""OpenAI completions and chat completions served through the router.

Every choice is one router request (`choices.py`); its outputs become the OpenAI response
(non-streaming) or SSE chunks (`data: {...}` lines, then `data: [DONE]`). The router's
refusals, and errors a request meets before its first output, become HTTP statuses before any
response starts (APIError, by the code table of `protocol/status.py`: 503 with Retry-After for a
lost worker); an error after the first output ends a stream with an error event of that code,
or a non-streaming request with its status.
One API request is prompts × n engine requests: at most server.limits.max_choices, and
server.max_pending_requests counts engine requests.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

from pydantic import BaseModel

from loopserve.cluster.router.core import Router
from loopserve.entrypoints.openai.chat_template import ChatTemplate
from loopserve.entrypoints.openai.choices import ChoiceStreams, Job
from loopserve.entrypoints.openai.errors import APIError, refusal
from loopserve.protocol.limits import RequestLimits, check_limits
from loopserve.protocol.outputs import RequestOutput
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.protocol.status import Code
from loopserve.entrypoints.openai.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionRequest,
    ChatCompletionResponse, ChatLogprobs, CompletionChoice, CompletionLogprobs,
    CompletionRequest, CompletionResponse, Delta, TokenLogprob, TopLogprob, Usage)
from loopserve.model.tokenizer import ByteTokenizer, HFTokenizer


class TokenText:
    """A token id as OpenAI's logprobs show it: its text and its bytes."""

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer) -> None:
        self._tok = tokenizer
        self._bytes = isinstance(tokenizer, ByteTokenizer)  # one byte per id: show that byte

    def text(self, token_id: int) -> str:
        return self._tok.decode([token_id])

    def bytes(self, token_id: int) -> list[int]:
        if self._bytes:
            return [token_id] if token_id < 256 else []
        return list(self.text(token_id).encode())


@dataclass
class _Choice:
    """One choice accumulated from its outputs (non-streaming responses and usage)."""

    text: str = ""
    tokens: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    prompt_tokens: int = 0
    finish_reason: str | None = None
    final: RequestOutput | None = None  # the last output (its error, if it failed)

    def add(self, out: RequestOutput) -> None:
        self.text += out.text_delta
        self.tokens.extend(out.new_token_ids)
        self.exit_depths.extend(out.exit_depths)
        self.logprobs.extend(out.logprobs or ())
        self.top.extend(out.top_logprobs or ())
        self.prompt_tokens = max(self.prompt_tokens, out.num_prompt_tokens)
        if out.finished:
            self.finish_reason, self.final = out.finish_reason, out


def _usage(choices: list[_Choice], n: int) -> Usage:
    """Prompt tokens once per prompt (choices are prompt-major, n per prompt)."""
    prompt = sum(c.prompt_tokens for c in choices[::n])
    completion = sum(len(c.tokens) for c in choices)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def sse(body: BaseModel | str) -> str:
    """One server-sent event: a JSON body, or the closing `[DONE]`."""
    return f"data: {body if isinstance(body, str) else body.model_dump_json()}\n\n"


def _failed(out: RequestOutput) -> APIError:
    """A request's error output as its status (the code it carries; none: an engine fault)."""
    return APIError.of(Code(out.error_code or Code.INTERNAL), out.error or "engine error")


class OpenAIServing:
    """The endpoints' logic over one router. Each call's `disconnected` completes when its
    client goes away: its choices are closed then, and every engine aborts their requests."""

    def __init__(self, router: Router, model_name: str, max_model_len: int,
                 tokenizer: ByteTokenizer | HFTokenizer, chat_template: ChatTemplate | None,
                 limits: RequestLimits, max_pending: int) -> None:
        self.router = router
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.tokens = TokenText(tokenizer)
        self.chat_template = chat_template  # None: the model has none, chat is refused
        self.limits = limits
        self.max_pending = max_pending
        self.in_flight = 0  # engine requests of open choices (one event loop: no lock)

    # ------------------------------------------------------------------ shared
    def _jobs(self, base: str, prompts: list[str | list[int]], n: int,
              params: Callable[[int], SamplingParams], fields: set[str],
              renames: dict[str, str]) -> list[Job]:
        cap, key = min((self.limits.max_choices, "server.limits.max_choices"),
                       (self.max_pending, "server.max_pending_requests"))
        if len(prompts) * n > cap:
            raise APIError.invalid(f"{len(prompts)} prompt(s) × n {n} = {len(prompts) * n} "
                                   f"choices, more than {key} ({cap})", "n")
        try:
            choice_params = [params(i) for i in range(n)]
            jobs = [Job(p, sp, f"{base}-{k * n + i}") for k, p in enumerate(prompts)
                    for i, sp in enumerate(choice_params)]
            for job in jobs:
                check_limits(job.request_id, job.prompt, job.params, self.limits)
        except ValueError as e:
            raise refusal(e, fields, renames) from None
        return jobs

    async def _open(self, jobs: list[Job], disconnected: Callable[[], Awaitable[object]],
                    fields: set[str], renames: dict[str, str]) -> ChoiceStreams:
        if self.in_flight + len(jobs) > self.max_pending:
            raise APIError.of(Code.RESOURCE_EXHAUSTED, (
                f"{self.in_flight} engine requests in flight and this request's {len(jobs)} "
                f"would pass server.max_pending_requests ({self.max_pending}); retry later"))
        self.in_flight += len(jobs)
        choices = ChoiceStreams(self.router, jobs, on_close=lambda: self._closed(len(jobs)))
        choices.close_when(disconnected)
        try:
            await choices.start()
        except Exception as e:
            if (error := refusal(e, fields, renames)) is None:
                raise
            raise error from None
        return choices

    def _closed(self, engine_requests: int) -> None:
        self.in_flight -= engine_requests

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"The model `{model}` does not exist (this server serves "
                           f"`{self.model_name}`)", "not_found_error", "model", "model_not_found")

    def _check_max_tokens(self, max_tokens: int | None, param: str) -> None:
        """A max_tokens no prompt fits beside is that field's fault, not the prompt's."""
        if max_tokens is not None and max_tokens >= self.max_model_len:
            raise APIError.invalid(
                f"{max_tokens} leaves no room for a prompt: prompt tokens + {param} must be <= "
                f"max_model_len ({self.max_model_len})", param)

    async def _collect(self, choices: ChoiceStreams, n: int) -> list[_Choice]:
        got = [_Choice() for _ in range(n)]
        async for i, out in choices:
            got[i].add(out)
        if failed := next((c for c in got if c.finish_reason == "error"), None):
            raise _failed(failed.final)
        return got

    # ------------------------------------------------------------------ completions
    async def completion(self, req: CompletionRequest, disconnected: Callable[[], Awaitable[object]]
                         ) -> CompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        self._check_max_tokens(req.max_tokens, "max_tokens")
        fields = set(CompletionRequest.model_fields)
        base = f"cmpl-{uuid.uuid4().hex}"
        prompts = req.prompts()
        jobs = self._jobs(base, prompts, req.n, req.params, fields, {})
        choices = await self._open(jobs, disconnected, fields, {})
        if req.stream:
            return self._completion_stream(req, base, choices, len(jobs))
        got = await self._collect(choices, len(jobs))

        def logprobs(c: _Choice) -> CompletionLogprobs | None:
            return None if req.logprobs is None else self._completion_logprobs(c.tokens, c.logprobs, c.top, 0)
        return CompletionResponse(
            id=base, model=self.model_name, usage=_usage(got, req.n),
            choices=[CompletionChoice(index=i, text=c.text, finish_reason=c.finish_reason,
                                      exit_depths=c.exit_depths, logprobs=logprobs(c))
                     for i, c in enumerate(got)])

    def _completion_logprobs(self, ids: Sequence[int], lps: Sequence[float],
                             tops: Sequence[Sequence[tuple[int, float]]], offset: int) -> CompletionLogprobs:
        """`offset`: where these tokens' text starts in the choice's text."""
        texts = [self.tokens.text(t) for t in ids]
        offsets = []
        for t in texts:
            offsets.append(offset)
            offset += len(t)
        return CompletionLogprobs(
            tokens=texts, token_logprobs=lps, text_offset=offsets,
            top_logprobs=[{self.tokens.text(t): lp for t, lp in top} for top in tops] or None)

    async def _completion_stream(self, req: CompletionRequest, base: str, choices: ChoiceStreams,
                                 n: int) -> AsyncIterator[str]:
        got = [_Choice() for _ in range(n)]
        try:
            async for i, out in choices:
                offset = len(got[i].text)
                got[i].add(out)
                if out.finished and out.finish_reason == "error":
                    yield sse(_failed(out).body())
                    break
                if out.new_token_ids or out.text_delta or out.finished:
                    lp = None if req.logprobs is None else self._completion_logprobs(
                        out.new_token_ids, out.logprobs or (), out.top_logprobs or (), offset)
                    yield sse(CompletionResponse(id=base, model=self.model_name, choices=[
                        CompletionChoice(index=i, text=out.text_delta, logprobs=lp,
                                         exit_depths=list(out.exit_depths),
                                         finish_reason=out.finish_reason if out.finished else None)]))
            else:
                if req.stream_options and req.stream_options.include_usage:
                    yield sse(CompletionResponse(id=base, model=self.model_name, choices=[],
                                                 usage=_usage(got, req.n)))
            yield sse("[DONE]")
        finally:
            choices.close()

    # ------------------------------------------------------------------ chat
    async def chat(self, req: ChatCompletionRequest, disconnected: Callable[[], Awaitable[object]]
                   ) -> ChatCompletionResponse | AsyncIterator[str]:
        self.check_model(req.model)
        if self.chat_template is None:
            raise APIError.invalid(
                f"this model ({self.model_name}) has no chat template: its checkpoint defines "
                f"none and server.chat_template is not set, so chat messages have no prompt form "
                f"it was trained on; use /v1/completions, or set server.chat_template to a Jinja "
                f"template file", "messages")
        if req.max_completion_tokens is not None:
            self._check_max_tokens(req.max_completion_tokens, "max_completion_tokens")
        else:
            self._check_max_tokens(req.max_tokens, "max_tokens")
        fields = set(ChatCompletionRequest.model_fields)
        renames = {"prompt": "messages", "logprobs": "top_logprobs"}
        base = f"chatcmpl-{uuid.uuid4().hex}"
        prompt = self.chat_template.render(req.messages)
        jobs = self._jobs(base, [prompt], req.n, req.params, fields, renames)
        choices = await self._open(jobs, disconnected, fields, renames)
        if req.stream:
            return self._chat_stream(req, base, choices)
        got = await self._collect(choices, req.n)
        return ChatCompletionResponse(
            id=base, model=self.model_name, usage=_usage(got, req.n),
            choices=[ChatChoice(index=i, message=AssistantMessage(content=c.text),
                                finish_reason=c.finish_reason, exit_depths=c.exit_depths,
                                logprobs=self._chat_logprobs(c.tokens, c.logprobs, c.top)
                                if req.logprobs else None)
                     for i, c in enumerate(got)])

    def _chat_logprobs(self, ids: Sequence[int], lps: Sequence[float],
                       tops: Sequence[Sequence[tuple[int, float]]]) -> ChatLogprobs:
        def top(t: int, lp: float) -> TopLogprob:
            return TopLogprob(token=self.tokens.text(t), logprob=lp, bytes=self.tokens.bytes(t))

        tops = list(tops) or [()] * len(ids)
        return ChatLogprobs(content=[
            TokenLogprob(**top(t, lp).model_dump(), top_logprobs=[top(a, b) for a, b in alts])
            for t, lp, alts in zip(ids, lps, tops)])

    async def _chat_stream(self, req: ChatCompletionRequest, base: str,
                           choices: ChoiceStreams) -> AsyncIterator[str]:
        created = int(time.time())
        got = [_Choice() for _ in range(req.n)]

        def chunk(*cs: ChatChunkChoice, usage: Usage | None = None) -> str:
            return sse(ChatCompletionChunk(id=base, created=created, model=self.model_name,
                                           choices=list(cs), usage=usage))
        try:
            for i in range(req.n):
                yield chunk(ChatChunkChoice(index=i, delta=Delta(role="assistant", content="")))
            async for i, out in choices:
                got[i].add(out)
                if out.finished and out.finish_reason == "error":
                    yield sse(_failed(out).body())
                    break
                if out.new_token_ids or out.text_delta:
                    lp = self._chat_logprobs(out.new_token_ids, out.logprobs or (),
                                             out.top_logprobs or ()) if req.logprobs else None
                    yield chunk(ChatChunkChoice(index=i, delta=Delta(content=out.text_delta),
                                                logprobs=lp, exit_depths=list(out.exit_depths)))
                if out.finished:
                    yield chunk(ChatChunkChoice(index=i, delta=Delta(), finish_reason=out.finish_reason))
            else:
                if req.stream_options and req.stream_options.include_usage:
                    yield chunk(usage=_usage(got, req.n))
            yield sse("[DONE]")
        finally:
            choices.close()
