"""The task the shipped `tiny-ouro-chains` model is trained on: chained variable lookups.

`c=b;a=7;e=4;b=a;f=e;c=?` asks for c; c=b, b=a, a=7, so the answer is `7` (then EOS). The
queried chain's length (`depth`, 1..MAX_DEPTH lookups) is what makes a problem hard: each
lookup is one more hop of attention, so deeper chains need more loops. Byte-level, so the
project's byte tokenizer serves it unchanged.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

NUM_STATEMENTS = 8  # assignments per prompt: the queried chain plus distractor chains
MAX_DEPTH = 6


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    depth: int


def make_problem(rng: random.Random, depth: int) -> Problem:
    """One prompt whose queried chain takes `depth` lookups; the other statements are
    distractor chains (1..3 long) over distinct letters, all statements shuffled."""
    if not 1 <= depth <= MAX_DEPTH:
        raise ValueError(f"depth must be in 1..{MAX_DEPTH}, got {depth}")
    names = rng.sample(string.ascii_lowercase, NUM_STATEMENTS)
    chains, left, at = [], NUM_STATEMENTS, 0
    for n in [depth] + [0] * NUM_STATEMENTS:
        n = n or min(left, rng.randint(1, 3))
        if left == 0:
            break
        chains.append(names[at:at + n])
        at, left = at + n, left - n
    statements = []
    for chain in chains:  # chain[0] = digit; chain[i] = chain[i-1]
        statements.append(f"{chain[0]}={rng.randint(0, 9)}")
        statements += [f"{chain[i]}={chain[i - 1]}" for i in range(1, len(chain))]
    values = {s[0]: s[2] for s in statements if s[2].isdigit()}
    for chain in chains:
        for i in range(1, len(chain)):
            values[chain[i]] = values[chain[0]]
    rng.shuffle(statements)
    query = chains[0][-1]
    return Problem(";".join(statements) + f";{query}=?", values[query], depth)


def make_problems(seed: int, n: int) -> list[Problem]:
    """`n` problems, depths cycling 1..MAX_DEPTH (equal counts per depth)."""
    rng = random.Random(seed)
    return [make_problem(rng, 1 + i % MAX_DEPTH) for i in range(n)]
