"""The task the shipped `tiny-ouro-chains` model is trained on: chained variable lookups.

`v=r;d=5;f=v;s=1;r=3;y=4;f=?` asks for f; f=v, v=r, r=3, so the answer is `3` (then EOS). The
queried chain's length (`depth`, 1..MAX_DEPTH lookups) is what makes a problem hard: each
lookup is one more hop of attention, so deeper chains need more loops. The other statements
are distractor chains whose roots hold other digits, so guessing a digit of the prompt is
not enough. Byte-level, so the project's byte tokenizer serves it unchanged.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

NUM_STATEMENTS = 6  # assignments per prompt: the queried chain plus distractor chains
MAX_DEPTH = 4
MAX_DISTRACTOR = 2  # statements per distractor chain (1..MAX_DISTRACTOR)


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str
    depth: int


def make_problem(rng: random.Random, depth: int, num_statements: int = NUM_STATEMENTS,
                 max_distractor: int = MAX_DISTRACTOR) -> Problem:
    """One prompt whose queried chain takes `depth` lookups; the other statements are
    distractor chains (1..max_distractor long) over distinct letters, every chain's root a
    distinct digit, all statements shuffled."""
    if not 1 <= depth <= min(MAX_DEPTH, num_statements):
        raise ValueError(f"depth must be in 1..{min(MAX_DEPTH, num_statements)}, got {depth}")
    lengths, left = [depth], num_statements - depth
    while left:
        lengths.append(min(left, rng.randint(1, max_distractor)))
        left -= lengths[-1]
    names = rng.sample(string.ascii_lowercase, num_statements)
    digits = rng.sample(string.digits, len(lengths))
    statements, at = [], 0
    for n, digit in zip(lengths, digits):  # chain[0] = digit; chain[i] = chain[i-1]
        chain = names[at:at + n]
        at += n
        statements.append(f"{chain[0]}={digit}")
        statements += [f"{chain[i]}={chain[i - 1]}" for i in range(1, n)]
    query = names[depth - 1]
    rng.shuffle(statements)
    return Problem(";".join(statements) + f";{query}=?", digits[0], depth)


def make_problems(seed: int, n: int) -> list[Problem]:
    """`n` problems, depths cycling 1..MAX_DEPTH (equal counts per depth)."""
    rng = random.Random(seed)
    return [make_problem(rng, 1 + i % MAX_DEPTH) for i in range(n)]
