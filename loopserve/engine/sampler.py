"""Token sampling: greedy, temperature, top-k, top-p, per-request seeded, logprobs.

Each draw uses a generator seeded from (request seed, output index), so a request's tokens
never depend on which other requests share its batch, and the RNG state that crosses a PD
handoff is just (seed, number of draws).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loopserve.protocol.sampling_params import SamplingParams

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


class DrawnTokens:
    """One token per row, drawn on the logits' device; the host reads them when it needs them.

    `token_ids` stay on the device (the next PRELUDE can embed them before the host has seen
    them); their copy to the host (with any logprobs) is queued behind the draw, so
    `samples()` waits for this draw only, not for work launched after it.
    """

    def __init__(self, token_ids: torch.Tensor, params: list[SamplingParams],
                 logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> None:
        self.token_ids = token_ids
        self._params = params
        self._host = [_to_host(t) for t in (token_ids, *(logprobs or ()))]
        self._event = None
        if token_ids.device.type == "cuda":
            self._event = torch.cuda.Event()
            self._event.record()
        self._samples: list[Sample] | None = None

    def ready(self) -> bool:
        """The draw and its copy are done (reading them will not wait)."""
        return self._event is None or self._event.query()

    def samples(self) -> list[Sample]:
        """Each row's Sample (waits for the draw)."""
        if self._samples is None:
            if self._event is not None:
                self._event.synchronize()
            self._samples = self._build()
        return self._samples

    def _build(self) -> list[Sample]:
        ids = self._host[0].tolist()
        if len(self._host) == 1:
            return [Sample(t) for t in ids]
        chosen, top_v, top_i = (t.tolist() for t in self._host[1:])
        out = []
        for i, p in enumerate(self._params):
            if p.logprobs is None:
                out.append(Sample(ids[i]))
            else:
                k = p.logprobs
                out.append(Sample(ids[i], chosen[i], tuple(zip(top_i[i][:k], top_v[i][:k]))))
        return out


def _to_host(t: torch.Tensor) -> torch.Tensor:
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    return host.copy_(t, non_blocking=True)


def draw_tokens(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                draw_index: list[int]) -> DrawnTokens:
    """Draw one token per row of `logits` [n, V] (fp32 on any device) without waiting for it."""
    logits = logits.float()
    greedy = torch.argmax(logits, dim=-1)
    ids = greedy
    if not all(p.greedy for p in params):
        rows = []
        for i, p in enumerate(params):
            if p.greedy:
                rows.append(greedy[i:i + 1])
                continue
            gen = torch.Generator(device=logits.device).manual_seed(draw_seed(seeds[i], draw_index[i]))
            rows.append(torch.multinomial(_filtered_probs(logits[i], p), 1, generator=gen))
        ids = torch.cat(rows)
    lp = None
    if any(p.logprobs is not None for p in params):
        logprobs = torch.log_softmax(logits, dim=-1)
        k = max(p.logprobs or 0 for p in params)
        top = torch.topk(logprobs, k, dim=-1) if k else None
        empty = logprobs.new_empty(len(params), 0)
        lp = (logprobs.gather(1, ids[:, None])[:, 0], top.values if top else empty,
              top.indices if top else empty.long())
    return DrawnTokens(ids, params, lp)
