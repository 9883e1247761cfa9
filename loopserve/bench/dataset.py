"""The benchmark's seeded requests: random token-id prompts of a length distribution, an
optional shared prefix, and an exact output length (sent with ignore_eos).

Prompts are token ids below 256, valid for the byte tokenizer and any larger vocabulary, so
the server sees exactly the requested input length whatever its tokenizer.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int


def _length(rng: random.Random, mean: int, range_ratio: float) -> int:
    """Uniform in [mean * (1 - r), mean * (1 + r)], at least 1."""
    lo, hi = int(mean * (1 - range_ratio)), int(mean * (1 + range_ratio))
    return max(1, rng.randint(lo, max(lo, hi)))


def random_requests(n: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    prefix_len: int = 0, seed: int = 0) -> list[BenchRequest]:
    if not 0 <= range_ratio < 1:
        raise ValueError(f"--range-ratio must be in [0, 1), got {range_ratio}")
    rng = random.Random(seed)
    prefix = [rng.randrange(256) for _ in range(prefix_len)]
    return [BenchRequest(prefix + [rng.randrange(256) for _ in range(_length(rng, input_len, range_ratio))],
                         _length(rng, output_len, range_ratio)) for _ in range(n)]


def arrival_offsets(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: a Poisson process at `rate`
    requests/s, or all at once when rate is infinite."""
    if rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed + 1)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out
