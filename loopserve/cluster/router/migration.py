"""Request migration: continue a stream on another worker after the one serving it failed.

A stream remembers what it has delivered. Its continuation is a fresh request whose prompt
is the original prompt plus every token already streamed, asking for the tokens still owed;
the caller sees one uninterrupted stream. Greedy continuations equal the uninterrupted run
(exits and Huginn's loop state are functions of the tokens and positions, not of how they
were batched); sampled ones restart the draw counter, so they are valid samples but not the
same ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from loopserve.protocol.outputs import RequestOutput
from loopserve.protocol.sampling_params import SamplingParams


@dataclass
class StreamHistory:
    prompt: str | list[int]
    params: SamplingParams
    prompt_ids: tuple[int, ...] | None = None  # known from the first output
    tokens: list[int] = field(default_factory=list)  # delivered to the caller, all attempts
    offset: int = 0  # tokens delivered before the current attempt started
    migrations: int = 0
    arrival_time: float | None = None
    first_token_time: float | None = None

    def record(self, out: RequestOutput) -> RequestOutput:
        """Note an output of the current attempt; return it as the caller's stream shows it."""
        if self.prompt_ids is None and out.prompt_token_ids is not None:
            self.prompt_ids = out.prompt_token_ids
        self.tokens.extend(out.new_token_ids)
        if self.arrival_time is None:
            self.arrival_time = out.arrival_time
        if self.first_token_time is None:
            self.first_token_time = out.first_token_time
        if not self.migrations:
            return out
        return replace(out, arrival_time=self.arrival_time, first_token_time=self.first_token_time,
                       num_prompt_tokens=len(self.prompt_ids or ()),
                       num_output_tokens=out.num_output_tokens + self.offset, prompt_token_ids=None)

    def continuation(self) -> tuple[str | list[int], SamplingParams]:
        """The prompt and params of the next attempt (starts it: later outputs are offset)."""
        self.migrations += 1
        self.offset = len(self.tokens)
        if not self.tokens:
            return self.prompt, self.params
        if self.prompt_ids is None:
            raise ValueError("tokens were streamed but the prompt's token ids are unknown")
        return ([*self.prompt_ids, *self.tokens],
                replace(self.params, max_tokens=self.params.max_tokens - len(self.tokens)))
