"""Serving a Hugging Face checkpoint: tiny random DoryForCausalLMs saved by transformers,
loaded by loopserve, generated through the engine as one concurrent batch (8 prompts of
1..24 tokens, 32 greedy tokens each) == transformers' greedy `generate`, colocated and
prefill→decode over a real NIXL transfer. Prompt logits at every position are checked
against transformers' forward in tests/model/test_dory.py (same checkpoints, 1e-4)."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DoryForCausalLM"):
    pytest.skip("transformers has no DoryForCausalLM", allow_module_level=True)

from loopserve.cli import main as cli_main  # noqa: E402
from loopserve.engine.config import EngineConfig  # noqa: E402
from loopserve.engine.engine_core import EngineCore  # noqa: E402
from loopserve.protocol.sampling_params import SamplingParams  # noqa: E402
from loopserve.scheduler import SpeculativeConfig  # noqa: E402
from tests.engine.conftest import make_engine, run_pd, run_to_completion  # noqa: E402
from tests.model.test_dory import MAX_NEW, hf_config, hf_generate, prompts, randomize  # noqa: E402

# (KV mode, loops, KV heads of 4 query heads): loops 1..4, both modes, MHA / GQA / MQA.
CONFIGS = [("per_loop", 1, 4), ("last_loop", 2, 2), ("per_loop", 3, 2), ("last_loop", 4, 1)]
PROMPTS = prompts(3)  # two of them contain token 0 (generate's pad id in hf_generate)
PARAMS = SamplingParams(max_tokens=MAX_NEW, ignore_eos=True, logprobs=0)
_CACHE: dict[tuple, tuple] = {}


def checkpoint(tmp_path_factory, cfg):
    """(save_pretrained dir, transformers generate's (tokens, logits) per prompt)."""
    if cfg not in _CACHE:
        mode, loops, kv_heads = cfg
        torch.manual_seed(0)
        hf = transformers.DoryForCausalLM._from_config(
            hf_config(loops, mode, kv_heads=kv_heads), attn_implementation="eager").eval()
        randomize(hf, seed=7 + loops)
        d = tmp_path_factory.mktemp(f"ckpt-{mode}-{loops}")
        hf.save_pretrained(d, safe_serialization=True)
        _CACHE[cfg] = d, [hf_generate(hf, p, loops) for p in PROMPTS]
    return _CACHE[cfg]


def submit(e: EngineCore) -> EngineCore:
    """The batch: every prompt added before the first step (one concurrent batch)."""
    for i, p in enumerate(PROMPTS):
        e.add_request(p, PARAMS, request_id=f"d{i}")
    return e


def assert_matches_generate(tokens: dict[str, list[int]], ref) -> None:
    for i, (p, (gen, _)) in enumerate(zip(PROMPTS, ref)):
        assert tokens[f"d{i}"] == gen, f"prompt {i} (len {len(p)})"


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"{c[0]}-L{c[1]}-kv{c[2]}")
def test_engine_batch_equals_transformers(tmp_path_factory, cfg):
    """Tokens == generate's, and each token's logprob == log_softmax of generate's logits."""
    d, ref = checkpoint(tmp_path_factory, cfg)
    e = submit(make_engine(str(d)))
    tokens, lps = {}, {}
    while e.has_unfinished():
        for o in e.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
            lps.setdefault(o.request_id, []).extend(o.logprobs)
    e.check_no_leaks()
    assert_matches_generate(tokens, ref)
    for i, (gen, logits) in enumerate(ref):
        want = torch.log_softmax(logits, -1).gather(1, torch.tensor(gen)[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(lps[f"d{i}"]), want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cfg", CONFIGS[2:], ids=lambda c: f"{c[0]}-L{c[1]}-kv{c[2]}")
def test_prefill_decode_serves_a_checkpoint(tmp_path_factory, cfg):
    """1P1D: the prompt's KV (flat + every loop plane) moves by a NIXL READ; the decode
    engine continues from it == the colocated engine == transformers."""
    d, ref = checkpoint(tmp_path_factory, cfg)
    colocated, _ = run_to_completion(submit(make_engine(str(d))))
    pd = run_pd(submit(make_engine(str(d), role="prefill")), make_engine(str(d), role="decode"))
    assert pd.tokens == colocated
    assert_matches_generate(pd.tokens, ref)


@pytest.mark.parametrize("option", [{"split_prefill": True}, {"speculative": SpeculativeConfig()}])
def test_last_loop_refuses_multi_token_pieces_after_the_prompt(tmp_path_factory, option):
    """Chunked prompts and draft verification would run several tokens in one piece, where
    the shared plane gives a different answer than transformers (speculative: 6 of these 8
    prompts diverged); per_loop accepts both."""
    d, _ = checkpoint(tmp_path_factory, CONFIGS[1])
    with pytest.raises(ValueError, match="last_loop"):
        EngineCore(EngineConfig(model=str(d), **option))
    EngineCore(EngineConfig(model=str(checkpoint(tmp_path_factory, CONFIGS[2])[0]), **option))


def test_cli_generate_serves_a_checkpoint_directory(tmp_path_factory, capsys):
    d, _ = checkpoint(tmp_path_factory, CONFIGS[1])
    assert cli_main(["generate", "hi", "--model", str(d), "--max-tokens", "5", "--json"]) == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert len(row["token_ids"]) == 5 and row["finish_reason"] == "length"


def test_unsupported_architecture_is_named(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match=r"unsupported architecture 'LlamaForCausalLM'.*DoryForCausalLM"):
        EngineCore(EngineConfig(model=str(tmp_path)))
