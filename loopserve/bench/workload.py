"""A seeded workload driven through a Router, with per-request latencies as the caller sees them.

In-process (the router, not a server's front): used by the job entry point (`--workload`),
`loopserve.bench.pd_compare` (benchmarks/pd_vs_colocated.py) and the cluster tests.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field

from loopserve.cluster.router.core import Router
from loopserve.protocol.sampling_params import SamplingParams

WORDS = ("loop", "depth", "token", "prefill", "decode", "block", "cache", "state", "exit", "gate")


@dataclass(frozen=True)
class WorkItem:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_s: float = 0.0  # offset from the start of the run


@dataclass
class RequestResult:
    request_id: str
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    exit_depths: list[int] = field(default_factory=list)
    top_logprobs: list[dict[int, float]] = field(default_factory=list)  # per token, when asked for
    finish_reason: str | None = None
    error: str | None = None
    submitted: float = 0.0
    first_token: float | None = None
    done: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.submitted

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token is None or self.done is None or len(self.token_ids) < 2:
            return None
        return (self.done - self.first_token) / (len(self.token_ids) - 1)


def make_workload(n: int, seed: int = 0, max_tokens: int = 16, rate: float | None = None,
                  prompt_words: tuple[int, int] = (2, 12), **params) -> list[WorkItem]:
    """`n` text prompts of random length; Poisson arrivals at `rate` req/s (None: all at once)."""
    rng = random.Random(seed)
    t, items = 0.0, []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(*prompt_words))]
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params)
        items.append(WorkItem(f"w{seed}-{i}", " ".join(words), sp, t))
        if rate:
            t += rng.expovariate(rate)
    return items


async def _one(router: Router, item: WorkItem, start: float) -> RequestResult:
    await asyncio.sleep(max(0.0, start + item.arrival_s - time.perf_counter()))
    res = RequestResult(item.request_id, submitted=time.perf_counter())
    try:
        async for out in router.generate(item.prompt, item.params, item.request_id):
            now = time.perf_counter()
            if out.new_token_ids and res.first_token is None:
                res.first_token = now
            res.token_ids.extend(out.new_token_ids)
            res.exit_depths.extend(out.exit_depths)
            res.top_logprobs.extend(dict(top) for top in out.top_logprobs or ())
            res.text += out.text_delta
            if out.finished:
                res.finish_reason, res.error, res.done = out.finish_reason, out.error, now
    except Exception as e:  # noqa: BLE001 - a rejected request is a result, not a crash
        res.finish_reason, res.error, res.done = "error", f"{type(e).__name__}: {e}", time.perf_counter()
    return res


async def run_workload(router: Router, items: list[WorkItem]) -> list[RequestResult]:
    """Submit every item at its arrival time, concurrently; results in item order."""
    start = time.perf_counter()
    return list(await asyncio.gather(*(_one(router, it, start) for it in items)))


def greedy_divergence(a: RequestResult, b: RequestResult) -> tuple[int, float] | None:
    """Where two greedy streams of one prompt first differ, and how near a tie it was there:
    the larger over both runs of (its token's logprob - the other run's token's logprob), inf
    where the other token is not in its top logprobs. None if the streams are equal."""
    if a.token_ids == b.token_ids:
        return None
    i = next((k for k, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y), None)
    if i is None or i >= min(len(a.top_logprobs), len(b.top_logprobs)):
        return (min(len(a.token_ids), len(b.token_ids)) if i is None else i), float("inf")
    gaps = [top[mine] - top[theirs] if mine in top and theirs in top else float("inf")
            for top, mine, theirs in ((a.top_logprobs[i], a.token_ids[i], b.token_ids[i]),
                                      (b.top_logprobs[i], b.token_ids[i], a.token_ids[i]))]
    return i, max(gaps)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty list."""
    if not values:
        raise ValueError("percentile of an empty list")
    s = sorted(values)
    k = max(0, min(len(s) - 1, math.ceil(q / 100 * len(s)) - 1))
    return s[k]


def summarize(results: list[RequestResult], wall_s: float, slo_tpot_s: float | None = None) -> dict:
    """Counts, throughput, TTFT/TPOT p50/p99; with an SLO, goodput: requests/s that finished
    with TPOT within it (single-token requests count: they have no TPOT to miss)."""
    ok = [r for r in results if r.error is None and r.finish_reason != "error"]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    tokens = sum(len(r.token_ids) for r in ok)
    out = {"requests": len(results), "ok": len(ok), "output_tokens": tokens,
           "wall_s": wall_s, "throughput_tok_s": tokens / wall_s if wall_s > 0 else 0.0}
    for name, vals in (("ttft", ttft), ("tpot", tpot)):
        if vals:
            out[f"{name}_p50_ms"] = 1e3 * percentile(vals, 50)
            out[f"{name}_p99_ms"] = 1e3 * percentile(vals, 99)
    if slo_tpot_s is not None and wall_s > 0:
        good = sum(1 for r in ok if r.tpot is None or r.tpot <= slo_tpot_s)
        out["goodput_req_s"] = good / wall_s
    return out
