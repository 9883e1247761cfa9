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
    prompt: list[int]  # token ids: the router tokenized a text prompt
    params: SamplingParams  # loop fields resolved
    tokens: list[int] = field(default_factory=list)  # delivered to the caller, all attempts
    offset: int = 0  # tokens delivered before the current attempt started
    migrations: int = 0
    arrival_time: float | None = None
    first_token_time: float | None = None

    def record(self, out: RequestOutput) -> RequestOutput:
        """Note an output of the current attempt; return it as the caller's stream shows it."""
        self.tokens.extend(out.new_token_ids)
        if self.arrival_time is None:
            self.arrival_time = out.arrival_time
        if self.first_token_time is None:
            self.first_token_time = out.first_token_time
        if not self.migrations:
            return out
        return replace(out, arrival_time=self.arrival_time, first_token_time=self.first_token_time,
                       num_prompt_tokens=len(self.prompt),
                       num_output_tokens=out.num_output_tokens + self.offset, prompt_token_ids=None)

    def continuation(self) -> tuple[list[int], SamplingParams]:
        """The prompt and params of the next attempt (starts it: later outputs are offset)."""
        self.migrations += 1
        self.offset = len(self.tokens)
        if not self.tokens:
            return self.prompt, self.params
        return ([*self.prompt, *self.tokens],
                replace(self.params, max_tokens=self.params.max_tokens - len(self.tokens)))
