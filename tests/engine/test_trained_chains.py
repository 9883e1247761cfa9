"""The shipped `tiny-ouro-chains` weights, through the engine: more loops answer better, and
adaptive exit at the documented threshold (README, docs/benchmarks.md) keeps most of that
accuracy for fewer loops. Held-out problems: seed 1234 (training used 0, validation 1)."""

from __future__ import annotations

import pytest

from loopserve.checkpoints.chains import make_problems
from loopserve.checkpoints.chains_eval import score
from loopserve.engine.llm import LLM

DOCUMENTED_THRESHOLD = 0.9
FULL_BEATS_ONE_LOOP_BY = 0.25  # accuracy points, full depth over 1 loop
ADAPTIVE_WITHIN = 0.05  # accuracy points below full depth at DOCUMENTED_THRESHOLD


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny-ouro-chains")


@pytest.fixture(scope="module")
def problems():
    return make_problems(1234, 300)


def test_full_depth_beats_one_loop(llm, problems):
    one = score(llm, problems, max_loops=1)
    full = score(llm, problems, max_loops=llm.engine.model.max_loops)
    assert full.accuracy >= one.accuracy + FULL_BEATS_ONE_LOOP_BY, (one, full)


def test_adaptive_exit_keeps_accuracy_with_fewer_loops(llm, problems):
    full_loops = llm.engine.model.max_loops
    full = score(llm, problems, max_loops=full_loops)
    adaptive = score(llm, problems, exit_threshold=DOCUMENTED_THRESHOLD)
    assert adaptive.accuracy >= full.accuracy - ADAPTIVE_WITHIN, (adaptive, full)
    assert adaptive.mean_loops < full_loops, adaptive


def test_readme_prompt_answers(llm):
    out = llm.generate("c=b;a=7;e=4;b=a;f=e;c=?")[0]
    assert out.text == "7", out
