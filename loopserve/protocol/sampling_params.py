"""Per-request generation parameters, validated up front so bad input never reaches a batch;
a bad field is a FieldError naming it."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from loopserve.protocol.status import FieldError

# Below this a temperature samples greedily (as vLLM's _SAMPLING_EPS): logits divided by a
# smaller one overflow float32, and the softmax of infinities is NaN.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 (or < GREEDY_BELOW) = greedy
    top_k: int = 0  # 0 = off; -1 too (vLLM's spelling)
    top_p: float = 1.0
    seed: int | None = None  # reproducible per request, independent of batch composition
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()  # stop strings; the reply is cut before the match
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; n >= 0: sampled token's logprob plus the top n
    # Loop parameters; None takes the model's defaults.
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None
    priority: int = 0  # lower = more important

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "stop", tuple([self.stop] if isinstance(self.stop, str) else self.stop))
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise FieldError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise FieldError("temperature", f"must be a finite number >= 0, got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise FieldError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise FieldError("top_k", f"must be >= -1 (0 or -1 = off), got {self.top_k}")
        if self.seed is not None and not (0 <= self.seed < 2**63):
            raise FieldError("seed", f"must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and not (0 <= self.logprobs <= 20):
            raise FieldError("logprobs", f"must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self.stop):
            raise FieldError("stop", "strings must be non-empty")
        if self.min_loops is not None and self.min_loops < 1:
            raise FieldError("min_loops", f"must be >= 1, got {self.min_loops}")
        if self.max_loops is not None and self.max_loops < 1:
            raise FieldError("max_loops", f"must be >= 1, got {self.max_loops}")
        if (
            self.min_loops is not None
            and self.max_loops is not None
            and self.min_loops > self.max_loops
        ):
            raise FieldError("min_loops", f"({self.min_loops}) must be <= max_loops ({self.max_loops})")
        if self.exit_threshold is not None and not (0.0 <= self.exit_threshold <= 1.0):
            raise FieldError("exit_threshold", f"must be in [0, 1], got {self.exit_threshold}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    def resolve_loops(self, default_min: int, default_max: int, default_threshold: float,
                      model_max: int) -> SamplingParams:
        """Fill unset loop fields from the model and check them against its bounds."""
        lo = self.min_loops if self.min_loops is not None else min(default_min, self.max_loops or default_min)
        hi = self.max_loops if self.max_loops is not None else max(default_max, lo)
        if lo > model_max:
            raise FieldError("min_loops", f"must be <= {model_max} for this model, got {lo}")
        if hi > model_max:
            raise FieldError("max_loops", f"must be <= {model_max} for this model, got {hi}")
        if lo > hi:
            raise FieldError("min_loops", f"({lo}) must be <= max_loops ({hi})")
        thr = self.exit_threshold if self.exit_threshold is not None else default_threshold
        return replace(self, min_loops=lo, max_loops=hi, exit_threshold=thr)

    def to_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, d: dict) -> SamplingParams:
        return cls(**d)


__all__ = ["SamplingParams"]
