"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded, logprobs.

Each draw uses a generator seeded from (request seed, output index), so a request's tokens
never depend on which other requests share its batch, and the RNG state that crosses a PD
handoff is just (seed, number of draws).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopserve.engine.sampling_params import SamplingParams

_MASK63 = (1 << 63) - 1


def draw_seed(seed: int, index: int) -> int:
    """A well-mixed 63-bit seed for draw `index` of a request (splitmix64 finaliser)."""
    z = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK63


@dataclass(frozen=True)
class Sample:
    token_id: int
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()


def _filtered_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    x = logits / p.temperature
    if 0 < p.top_k < x.numel():
        kth = torch.topk(x, p.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if p.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = cum - sorted_p >= p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(0, order, sorted_p)
    return probs


def sample_rows(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                draw_index: list[int]) -> list[Sample]:
    """Sample one token per row of `logits` [n, V] (fp32 on any device)."""
    logits = logits.float()
    greedy_ids = torch.argmax(logits, dim=-1).tolist()
    want_lp = any(p.logprobs is not None for p in params)
    logprobs = torch.log_softmax(logits, dim=-1) if want_lp else None
    out: list[Sample] = []
    for i, p in enumerate(params):
        if p.greedy:
            tok = greedy_ids[i]
        else:
            gen = torch.Generator(device=logits.device).manual_seed(draw_seed(seeds[i], draw_index[i]))
            probs = _filtered_probs(logits[i], p)
            tok = int(torch.multinomial(probs, 1, generator=gen).item())
        if p.logprobs is None:
            out.append(Sample(tok))
            continue
        row = logprobs[i]
        top: tuple[tuple[int, float], ...] = ()
        if p.logprobs:
            v, ix = torch.topk(row, p.logprobs)
            top = tuple(zip(ix.tolist(), v.tolist()))
        out.append(Sample(tok, float(row[tok]), top))
    return out
