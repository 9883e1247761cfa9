"""The Ouro-style family against transformers' own Ouro class, once transformers has one
(5.24 has none: this module skips). loopserve saves tiny-ouro with Ouro's public names and
config keys; transformers loads that directory; prompt logits at full depth agree to 1e-4
and the engine's greedy tokens (one concurrent batch, fixed depth) equal `generate`'s."""

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "OuroForCausalLM"):
    pytest.skip("transformers has no OuroForCausalLM", allow_module_level=True)

from loopserve.engine.sampling_params import SamplingParams  # noqa: E402
from loopserve.model.dense_reference import dense_forward  # noqa: E402
from loopserve.model.registry import resolve_model, save_model  # noqa: E402
from tests.engine.conftest import make_engine  # noqa: E402

PROMPTS = [[5, 17, 3], [200, 1, 9, 9, 44, 12, 80], [7] * 13, [1]]
MAX_NEW = 16


def test_ouro_checkpoint_equals_transformers(tmp_path):
    model = resolve_model("tiny-ouro", seed=0)
    save_model(model, tmp_path)
    hf = transformers.OuroForCausalLM.from_pretrained(tmp_path, attn_implementation="eager").eval()
    loops = model.max_loops
    for p in PROMPTS:
        ours, _ = dense_forward(model, p, loops, loops, 1.0)
        with torch.no_grad():
            theirs = hf(torch.tensor([p])).logits[0].float()
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=0)
    e = make_engine(str(tmp_path))
    params = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, min_loops=loops, exit_threshold=1.0)
    for i, p in enumerate(PROMPTS):
        e.add_request(p, params, request_id=f"o{i}")
    got: dict[str, list[int]] = {}
    while e.has_unfinished():
        for o in e.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    e.check_no_leaks()
    for i, p in enumerate(PROMPTS):
        ids = torch.tensor([p])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW,
                          min_new_tokens=MAX_NEW, do_sample=False)
        assert got[f"o{i}"] == out[0, len(p):].tolist(), f"prompt {i}"
