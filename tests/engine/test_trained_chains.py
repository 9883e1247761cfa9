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
# The shipped weights (2100 CPU steps) have not learned the lookup yet: ~0.4 accuracy at every
# depth, i.e. picking among the prompt's digits. Issue 30 stays open until these pass.
NOT_YET_LEARNED = pytest.mark.xfail(reason="shipped weights do not solve chained lookups yet (issue 30)",
                                    strict=False)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="tiny-ouro-chains")


@pytest.fixture(scope="module")
def problems():
    return make_problems(1234, 300)


@NOT_YET_LEARNED
def test_full_depth_beats_one_loop(llm, problems):
    one = score(llm, problems, max_loops=1)
    full = score(llm, problems, max_loops=llm.engine.model.max_loops)
    assert full.accuracy >= one.accuracy + FULL_BEATS_ONE_LOOP_BY, (one, full)


@NOT_YET_LEARNED
def test_adaptive_exit_keeps_accuracy_with_fewer_loops(llm, problems):
    full_loops = llm.engine.model.max_loops
    full = score(llm, problems, max_loops=full_loops)
    adaptive = score(llm, problems, exit_threshold=DOCUMENTED_THRESHOLD)
    assert adaptive.accuracy >= full.accuracy - ADAPTIVE_WITHIN, (adaptive, full)
    assert adaptive.mean_loops < full_loops, adaptive


@NOT_YET_LEARNED
def test_readme_prompt_answers(llm):
    out = llm.generate("m=p;w=8;f=m;k=a;p=3;b=2;e=k;a=1;e=?")[0]
    assert out.text == "1", out
