"""Serving a Hugging Face checkpoint: a tiny random DoryForCausalLM saved by transformers,
loaded by loopserve, generated through the engine as one concurrent batch == transformers."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DoryForCausalLM"):
    pytest.skip("transformers has no DoryForCausalLM", allow_module_level=True)

from loopserve.cli import main as cli_main  # noqa: E402
from loopserve.engine.config import EngineConfig  # noqa: E402
from loopserve.engine.engine_core import EngineCore  # noqa: E402
from loopserve.engine.sampling_params import SamplingParams  # noqa: E402
from tests.model.test_dory import MAX_NEW, hf_config, hf_generate, prompts, randomize  # noqa: E402


@pytest.fixture(scope="module", params=[("per_loop", 3), ("per_loop", 1)])
def checkpoint(request, tmp_path_factory):
    mode, loops = request.param
    torch.manual_seed(0)
    hf = transformers.DoryForCausalLM._from_config(hf_config(loops, mode), attn_implementation="eager").eval()
    randomize(hf, seed=7 + loops)
    d = tmp_path_factory.mktemp(f"ckpt-{mode}")
    hf.save_pretrained(d, safe_serialization=True)
    return hf, d, loops, mode


@torch.no_grad()
def hf_full_greedy(hf, prompt, n):
    """Greedy decoding with transformers' full forward each step (no cache)."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_engine_batch_equals_transformers(checkpoint):
    """Token for token vs transformers' own model. Its cached `generate` is the reference
    where it agrees with its full forward; in some per_loop cases here it does not (e.g.
    window 8, prompt of 5: generate's 4th token differs from the full forward's argmax), and
    loopserve follows the full forward."""
    hf, d, loops, mode = checkpoint
    e = EngineCore(EngineConfig(model=str(d), block_size=4, num_blocks=1024, max_model_len=128))
    ps = prompts(3)
    for i, p in enumerate(ps):
        e.add_request(p, SamplingParams(max_tokens=MAX_NEW, ignore_eos=True), request_id=f"d{i}")
    outs = {}
    while e.has_unfinished():
        for o in e.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
    e.check_no_leaks()
    agree_generate = 0
    for i, p in enumerate(ps):
        gen = hf_generate(hf, p, loops)[0]
        # last_loop is defined by incremental decoding (earlier loops read the last loop's
        # past), so transformers' generate is its reference; per_loop's is the full forward.
        ref = gen if mode == "last_loop" else hf_full_greedy(hf, p, MAX_NEW)
        assert outs[f"d{i}"] == ref, f"prompt {i} (len {len(p)})"
        agree_generate += outs[f"d{i}"] == gen
    assert agree_generate >= len(ps) // 2


def test_cli_generate_serves_a_checkpoint_directory(checkpoint, capsys):
    _, d, _, _ = checkpoint
    assert cli_main(["generate", "hi", "--model", str(d), "--max-tokens", "5", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(row["token_ids"]) == 5 and row["finish_reason"] == "length"


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"unsupported architecture 'LlamaForCausalLM'.*DoryForCausalLM"):
        EngineCore(EngineConfig(model=str(tmp_path)))
