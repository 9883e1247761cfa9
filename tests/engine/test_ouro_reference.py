"""The Ouro-style family against Ouro's published forward pass re-stated in plain PyTorch
(tests/engine/ouro_reference.py; no loopserve code), on the random-weight `tiny-ouro` (saved
with Ouro's names and config keys; grouped-query attention) and the shipped trained
`tiny-ouro-chains`:
- logits after every loop agree to 1e-4 (loopserve's dense forward, prompts of 1..40 tokens);
- the engine's greedy tokens at every fixed depth, several requests batched, are the
  reference's argmax at each step along the engine's own sequence (an equal-within-1e-4
  runner-up counts as a tie: the two sums differ in rounding, not in math);
- adaptive exit: each one-token prompt's first token exits at the first loop whose cumulative
  exit probability reaches the threshold, as `OuroForCausalLM(exit_threshold=...)` picks it."""

from __future__ import annotations

import random

import pytest
import torch

from loopserve.model.dense_reference import dense_forward
from loopserve.model.registry import CHECKPOINT_DIR, resolve_model, save_model
from loopserve.protocol.sampling_params import SamplingParams
from tests.engine.conftest import make_engine, run_to_completion
from tests.engine.ouro_reference import OuroReference

CHAINS = list(b"o=7;z=o;c=8;p=c;j=a;a=p;j=?")
_rng = random.Random(0)
PROMPTS = [[5, 17, 3], [200, 1, 9, 9, 44, 12, 80], [7] * 13, [1], CHAINS,
           [_rng.randrange(256) for _ in range(40)]]
MAX_NEW = 12
TIE = 1e-4


@pytest.fixture(scope="module", params=["tiny-ouro", "tiny-ouro-chains"])
def checkpoint(request, tmp_path_factory) -> str:
    if request.param == "tiny-ouro-chains":
        return str(CHECKPOINT_DIR / "tiny-ouro-chains")
    d = tmp_path_factory.mktemp("tiny-ouro")
    save_model(resolve_model("tiny-ouro", seed=0), d)
    return str(d)


def test_logits_after_every_loop_equal_the_reference(checkpoint):
    model, ref = resolve_model(checkpoint), OuroReference(checkpoint)
    assert ref.loops == model.max_loops == 4
    for p in PROMPTS:
        theirs, _ = ref.forward(p)
        for loops in range(1, ref.loops + 1):
            ours, depth = dense_forward(model, p, loops, loops, 1.0)
            assert depth.tolist() == [loops] * len(p)
            torch.testing.assert_close(ours, theirs[loops - 1], atol=1e-4, rtol=0)


def _assert_reference_greedy(ref: OuroReference, prompt: list[int], tokens: list[int], loops: int) -> None:
    ids = list(prompt)
    for step, tok in enumerate(tokens):
        logits = ref.forward(ids)[0][loops - 1, -1]
        assert logits.max() - logits[tok] <= TIE, (
            f"prompt {prompt[:8]}…, {loops} loops, token {step}: engine {tok}, reference {int(logits.argmax())}")
        ids.append(tok)


@pytest.mark.parametrize("loops", [1, 2, 4])
def test_engine_greedy_tokens_are_the_references(checkpoint, loops):
    ref, e = OuroReference(checkpoint), make_engine(checkpoint)
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, min_loops=loops, max_loops=loops,
                            exit_threshold=1.0)
    tokens, depths = run_to_completion(e, arrivals=[(f"o{i}", p, params) for i, p in enumerate(PROMPTS)])
    for i, p in enumerate(PROMPTS):
        assert len(tokens[f"o{i}"]) == MAX_NEW and set(depths[f"o{i}"]) == {loops}
        _assert_reference_greedy(ref, p, tokens[f"o{i}"], loops)


def test_trained_answer_at_full_depth_is_the_references(checkpoint):
    if not checkpoint.endswith("tiny-ouro-chains"):
        pytest.skip("the trained checkpoint only")
    assert bytes(OuroReference(checkpoint).greedy(CHAINS, 1, 4)) == b"8"


@pytest.mark.parametrize("threshold", [0.3, 0.6, 0.9])
def test_adaptive_exit_loop_is_the_references(checkpoint, threshold):
    ref, e = OuroReference(checkpoint), make_engine(checkpoint)
    prompts = [[t] for t in range(0, 256, 7)]
    params = SamplingParams(max_tokens=1, ignore_eos=True, exit_threshold=threshold)
    tokens, depths = run_to_completion(e, arrivals=[(f"x{i}", p, params) for i, p in enumerate(prompts)])
    exits = []
    for i, p in enumerate(prompts):
        logits, cdf = ref.forward(p)
        if (cdf[:, 0] - threshold).abs().min() < 1e-5:
            continue  # the gate sits on the threshold: either side is right
        want = int(ref.exit_loop(cdf[:, 0], threshold))
        assert depths[f"x{i}"] == [want], f"token {p[0]}: cumulative exit {cdf[:, 0].tolist()}"
        step = logits[want - 1, 0]
        assert step.max() - step[tokens[f"x{i}"][0]] <= TIE
        exits.append(want)
    assert len(exits) >= len(prompts) - 2
