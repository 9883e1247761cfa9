"""Engine-side request: token ids, outputs, stop handling (the scheduler sees only lengths)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from loopserve.protocol.outputs import RequestOutput
from loopserve.engine.sampler import Sample
from loopserve.protocol.sampling_params import SamplingParams


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # loop fields resolved
    seed: int
    detok: object  # an incremental detokenizer (tokenizer.py)
    eos_token_id: int | None = None
    arrival_time: float = field(default_factory=time.time)
    output_token_ids: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)  # speculation round in progress
    exit_depth: dict[int, int] = field(default_factory=dict)  # position -> depth it exited at
    text: str = ""
    first_token_time: float | None = None
    finish_reason: str | None = None
    final_sent: bool = False  # the finished output went out: nothing more is streamed
    # Not yet streamed:
    _new_tokens: list[int] = field(default_factory=list)
    _new_depths: list[int] = field(default_factory=list)
    _new_times: list[float] = field(default_factory=list)
    _new_logprobs: list[float] = field(default_factory=list)
    _new_top: list[tuple[tuple[int, float], ...]] = field(default_factory=list)
    _streamed_chars: int = 0
    _prompt_sent: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    def token_at(self, position: int) -> int:
        """The input token at `position` (prompt, output, or a speculative draft)."""
        if position < self.prompt_len:
            return self.prompt_token_ids[position]
        i = position - self.prompt_len
        if i < len(self.output_token_ids):
            return self.output_token_ids[i]
        return self.draft_token_ids[i - len(self.output_token_ids)]

    def tokens_at(self, positions: list[int]) -> list[int]:
        """token_at of each position; a contiguous run inside the prompt (a prefill chunk) is
        one slice, not a call per token."""
        if positions and positions[-1] < self.prompt_len and list(positions) == list(range(positions[0], positions[-1] + 1)):
            return list(self.prompt_token_ids[positions[0]:positions[-1] + 1])
        return [self.token_at(p) for p in positions]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, sample: Sample, producing_position: int) -> None:
        """Add one generated token; sets finish_reason on a stop condition."""
        now = time.time()
        if self.first_token_time is None:
            self.first_token_time = now
        self.output_token_ids.append(sample.token_id)
        self._new_tokens.append(sample.token_id)
        self._new_depths.append(self.exit_depth.get(producing_position, 0))
        self._new_times.append(now)
        if sample.logprob is not None:
            self._new_logprobs.append(sample.logprob)
            self._new_top.append(sample.top_logprobs)
        old_len = len(self.text)
        self.text += self.detok.add(sample.token_id)
        p = self.params
        if sample.token_id in p.stop_token_ids or (
            not p.ignore_eos and self.eos_token_id is not None and sample.token_id == self.eos_token_id
        ):
            self.finish_reason = "stop"
        elif p.stop:  # a match may begin in the held-back tail of the text before this token
            start = max(0, old_len - self._stop_hold())
            hits = [i for s in p.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]  # the reply is cut before the stop string
                self.finish_reason = "stop"
        if self.finish_reason is None and len(self.output_token_ids) >= p.max_tokens:
            self.finish_reason = "length"

    def resume(self, output_token_ids: list[int], exit_depth: dict[int, int],
               first_token_time: float | None) -> None:
        """Continue a request another engine started (a handoff): its outputs so far were
        streamed there, except the text a stop string could still claim, streamed from here."""
        for t in output_token_ids:  # replay them into the detokenizer
            self.text += self.detok.add(t)
        self._streamed_chars = max(0, len(self.text) - self._stop_hold())
        self.output_token_ids = list(output_token_ids)
        self.exit_depth = dict(exit_depth)
        self.first_token_time = first_token_time
        self._prompt_sent = True

    def has_news(self) -> bool:
        """Tokens appended since the last take_output."""
        return bool(self._new_tokens)

    def _stop_hold(self) -> int:
        """Characters held back while a stop string could still match across the next token."""
        return max(map(len, self.params.stop)) - 1 if self.params.stop else 0

    def take_output(self, error: str | None = None, error_code: str | None = None) -> RequestOutput:
        """The news since the last call (tokens, text, depths, timings) as one RequestOutput."""
        hold = 0 if self.finished else self._stop_hold()
        upto = max(self._streamed_chars, len(self.text) - hold)
        delta, self._streamed_chars = self.text[self._streamed_chars : upto], upto
        out = RequestOutput(
            request_id=self.request_id,
            new_token_ids=tuple(self._new_tokens),
            text_delta=delta,
            exit_depths=tuple(self._new_depths),
            logprobs=tuple(self._new_logprobs) if self.params.logprobs is not None else None,
            top_logprobs=tuple(self._new_top) if self.params.logprobs else None,
            finished=self.finished,
            finish_reason=self.finish_reason,
            error=error,
            error_code=error_code,
            arrival_time=self.arrival_time,
            first_token_time=self.first_token_time,
            token_times=tuple(self._new_times),
            num_prompt_tokens=self.prompt_len,
            num_output_tokens=len(self.output_token_ids),
            prompt_token_ids=None if self._prompt_sent else tuple(self.prompt_token_ids),
        )
        self._prompt_sent = True
        self.final_sent = self.finished
        self._new_tokens, self._new_depths, self._new_times = [], [], []
        self._new_logprobs, self._new_top = [], []
        return out
