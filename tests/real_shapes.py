"""Real shapes for the default suite: prompts longer than every initial capacity the engine
has, on the tiny models (cheap on CPU), checked against the dense full-recompute reference.

Main once crashed on every prompt past the state slab's 256 initial rows while every test
used prompts of at most 26 tokens (issue 24). The lengths here are tied to the capacities
they must exceed (`check_lengths_exceed_capacities`), so they stay meaningful if a default
changes:

- 300: past the state slab's initial rows (a prompt's PRELUDE takes a row per token);
- 1100: past EngineConfig's default max_model_len and several CUDA-graph context buckets;
- 2100: past the default max_num_batched_tokens (one prompt bigger than a default batch)
  and 2048-position context buckets, and a pool of default size (it needs `NUM_BLOCKS`).

The dense reference recomputes the whole sequence for every token (O(n^2) per token), so
each (prompt, params) is computed once per session (tests/engine/conftest.py `reference`)
and every request here is the same in every test: few output tokens, explicit seeds.
"""

from __future__ import annotations

import inspect
import random
from dataclasses import dataclass

from loopserve.engine.config import EngineConfig
from loopserve.engine.cuda_graphs import MIN_CONTEXT_BUCKET
from loopserve.engine.state_store import StateStore
from loopserve.intmath import cdiv
from loopserve.protocol.sampling_params import SamplingParams

SLAB_ROWS = inspect.signature(StateStore.__init__).parameters["capacity"].default
DEFAULTS = EngineConfig()

LONG_PROMPTS = (300, 1100, 2100)
SHORT_PROMPTS = (1, 9, 40, 130, 257)  # the rest of a batch: decode rows next to long prefills
ORDER = (1, 130, 300, 9, 257, 1100, 40, 2100)  # arrival order: long prompts among short ones
MAX_MODEL_LEN = 4096
BLOCK_SIZE = DEFAULTS.block_size
LONG_TOKENS = 4  # output tokens of a long prompt (the reference's cost is per token)
SHORT_TOKENS = 6
# every request of `workload()` fits at once (each looped depth is a plane of blocks)
NUM_BLOCKS = 2048
MAX_NUM_SEQS = 4  # below the number of requests in `workload()`: some wait for a seat

# An engine at real shapes: everything else at its default.
ENGINE = {"block_size": BLOCK_SIZE, "max_model_len": MAX_MODEL_LEN, "num_blocks": NUM_BLOCKS,
          "max_num_seqs": MAX_NUM_SEQS}


def check_lengths_exceed_capacities() -> None:
    assert LONG_PROMPTS[0] > SLAB_ROWS, "the shortest long prompt must outgrow the state slab"
    assert LONG_PROMPTS[1] > DEFAULTS.max_model_len
    assert LONG_PROMPTS[2] > DEFAULTS.scheduler.max_num_batched_tokens
    assert LONG_PROMPTS[2] > 16 * MIN_CONTEXT_BUCKET  # several context buckets up
    max_loops = 4  # the tiny models' depth: one plane of blocks per depth
    assert cdiv(LONG_PROMPTS[2] + LONG_TOKENS, DEFAULTS.block_size) * max_loops > DEFAULTS.num_blocks
    assert max(LONG_PROMPTS) + LONG_TOKENS <= MAX_MODEL_LEN
    assert sorted(ORDER) == sorted(LONG_PROMPTS + SHORT_PROMPTS) and len(ORDER) > MAX_NUM_SEQS


@dataclass(frozen=True)
class Item:
    request_id: str
    prompt: list[int]
    params: SamplingParams


def prompt_of(n: int) -> list[int]:
    rng = random.Random(n)
    return [rng.randrange(0, 256) for _ in range(n)]


def workload(lengths=ORDER) -> list[Item]:
    """Long and short prompts interleaved; adaptive exit on most (tokens of one prompt exit
    at different depths, so its depth planes differ), all greedy with explicit seeds."""
    items = []
    for n in lengths:
        long = n in LONG_PROMPTS
        thr = 1.0 if n in (1100, 40) else 0.7
        params = SamplingParams(max_tokens=LONG_TOKENS if long else SHORT_TOKENS, ignore_eos=True,
                                min_loops=1, exit_threshold=thr, seed=n)
        items.append(Item(f"p{n}", prompt_of(n), params))
    return items
