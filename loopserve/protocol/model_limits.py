"""ModelLimits: what an engine accepts of a request, as plain data, so the router checks a
request once, on the typed request, before any worker sees it.

A worker hands its engine's limits over (`model_limits()`); the router tokenizes a text
prompt with the tokenizer they name, checks the token ids and parameters against them and
sends token ids with the loop parameters resolved. The engine runs the same `check` (it has
callers besides the router: `LLM`, a continuation), which a routed request passes unchanged.
Every refusal is a FieldError naming the field and the limit.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loopserve.protocol.sampling_params import SamplingParams
from loopserve.protocol.status import FieldError


@dataclass(frozen=True)
class ModelLimits:
    model: str
    tokenizer: str | None  # the tokenizers JSON file; None: the byte tokenizer
    max_model_len: int  # prompt + max_tokens
    vocab_size: int
    default_loops: tuple[int, int, float]  # the model's default min_loops, max_loops, exit_threshold
    max_loops: int  # the model's bound

    def check(self, token_ids: Sequence[int], params: SamplingParams) -> SamplingParams:
        """`params` with the loop fields resolved; FieldError names the first field over its limit."""
        if not token_ids:
            raise FieldError("prompt", "must not be empty")
        vocab = self.vocab_size
        bad = next((t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab), None)
        if bad is not None:
            raise FieldError("prompt", f"token id {bad!r} is outside the vocabulary [0, {vocab})")
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise FieldError("prompt", f"length ({len(token_ids)}) + max_tokens ({params.max_tokens}) "
                                       f"must be <= max_model_len ({self.max_model_len})")
        return params.resolve_loops(*self.default_loops, self.max_loops)
