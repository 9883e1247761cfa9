"""Score a served model on chained lookups through the engine (`LLM.generate`, greedy), so
benchmarks and tests measure what a client gets, early exit included."""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.checkpoints.chains import MAX_DEPTH, Problem
from loopserve.engine.llm import LLM
from loopserve.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class Score:
    accuracy: float
    mean_loops: float  # loops the answer token ran, averaged over problems
    by_depth: tuple[float, ...]  # accuracy per chain depth 1..MAX_DEPTH


def score(llm: LLM, problems: list[Problem], max_loops: int | None = None,
          exit_threshold: float = 1.0) -> Score:
    """Exact match of the answer token (the first generated one)."""
    params = SamplingParams(max_tokens=1, max_loops=max_loops, exit_threshold=exit_threshold)
    outs = llm.generate([p.prompt for p in problems], params)
    ok = [o.text == p.answer for o, p in zip(outs, problems)]
    loops = [o.exit_depths[0] for o in outs]
    by_depth = []
    for d in range(1, MAX_DEPTH + 1):
        hits = [k for k, p in zip(ok, problems) if p.depth == d]
        by_depth.append(sum(hits) / max(1, len(hits)))
    return Score(sum(ok) / len(ok), sum(loops) / len(loops), tuple(by_depth))
