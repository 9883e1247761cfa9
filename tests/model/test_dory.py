"""Dory (issue 8): loopserve's own Dory code == transformers' DoryForCausalLM.

Tiny random transformers models are saved with `save_pretrained` and loaded through
`load_model(dir)`; prompt logits match to 1e-4 (fp32), and paged incremental execution of
8 concurrent requests gives transformers' greedy `generate` tokens, in both KV modes.
"""

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DoryForCausalLM"):
    pytest.skip("this transformers has no Dory", allow_module_level=True)

from loopserve.model.config import parse_config  # noqa: E402
from loopserve.model.dense_reference import dense_forward, dense_greedy_generate  # noqa: E402
from loopserve.model.registry import load_model  # noqa: E402
from tests.model.test_paged_equivalence import Driver  # noqa: E402

PROMPT_LENS = [1, 3, 5, 8, 9, 13, 17, 24]
MAX_NEW = 32
LAYER_TYPES = ["sliding_attention", "full_attention", "full_attention",
               "sliding_attention", "sliding_attention", "full_attention"]


def hf_config(loops, mode, tie=False, kv_heads=2):
    return transformers.DoryConfig(
        vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, n_input_layers=2,
        n_recurrent_layers=2, n_output_layers=2, n_recurrent_loops=loops,
        recurrent_kv_cache_mode=mode, sliding_window=8, layer_types=LAYER_TYPES,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 500_000.0}},
        initializer_range=0.02, ngpt_alpha_init=0.05, max_position_embeddings=256,
        tie_word_embeddings=tie, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        architectures=["DoryForCausalLM"],
    )


@torch.no_grad()
def randomize(model, seed):
    """Every parameter random (not HF's constant init), scaled so activations stay O(1)."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    ir, alpha, h = cfg.initializer_range, cfg.ngpt_alpha_init, cfg.hidden_size
    rn = lambda p: torch.randn(p.shape, generator=g)  # noqa: E731
    for name, p in model.named_parameters():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("sqk", "s_gate"):
            p.copy_(ir * (1 + 0.2 * rn(p)))
        elif leaf in ("lambda_1", "lambda_2"):  # signed: the rate takes abs()
            p.copy_(ir / alpha * (0.1 + 0.2 * torch.rand(p.shape, generator=g)) * rn(p).sign())
        elif leaf in ("suv_gate", "suv_up"):
            p.copy_(1 + 0.2 * rn(p))
        elif leaf == "logit_scale":
            p.copy_(ir * math.sqrt(h) * (1 + 0.2 * rn(p)))
        elif "embed_tokens" in name:
            p.copy_(rn(p))
        else:
            p.copy_(rn(p) / math.sqrt(p.shape[-1]))


_CACHE = {}


def models(tmp_path_factory, loops, mode, tie=False):
    key = (loops, mode, tie)
    if key not in _CACHE:
        torch.manual_seed(0)
        hf = transformers.DoryForCausalLM._from_config(hf_config(loops, mode, tie), attn_implementation="eager")
        randomize(hf, seed=loops * 10 + (mode == "last_loop") + 2 * tie)
        hf.eval()
        d = tmp_path_factory.mktemp(f"dory-{loops}-{mode}-{tie}")
        hf.save_pretrained(d, safe_serialization=True)
        _CACHE[key] = (hf, load_model(d))
    return _CACHE[key]


def prompts(seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 384, (n,), generator=g).tolist() for n in PROMPT_LENS]


@torch.no_grad()
def hf_generate(hf, prompt, loops):
    hf.config.n_recurrent_loops = loops  # transformers reads it at every forward
    ids = torch.tensor([prompt])
    # An explicit mask: without one, generate infers it from `input_ids != pad_token_id` and
    # would treat every prompt token equal to the pad id as padding (shifting positions).
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                      max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW, output_logits=True,
                      return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).float()


class DoryDriver(Driver):
    """The paged-equivalence Driver with Dory's plane mapping: a request holds
    `kv_planes(max_loops)` looped planes and loop d uses plane `plane_of_depth(d)`."""

    def __init__(self, m, block_size):
        super().__init__(m, block_size)
        allocate = self.kvm.allocate
        self.kvm.allocate = lambda rid, n, planes: allocate(rid, n, m.kv_planes(planes))

    def fill_deeper(self, rid, p, d, planes):
        if not self.m.last_loop_kv:  # one shared plane: nothing to fill
            super().fill_deeper(rid, p, d, planes)


@pytest.mark.parametrize("mode", ["per_loop", "last_loop"])
@pytest.mark.parametrize("loops", [1, 2, 3, 4])
def test_prompt_logits_match_transformers(tmp_path_factory, loops, mode):
    hf, m = models(tmp_path_factory, loops, mode)
    assert m.kv_planes(loops) == (1 if mode == "last_loop" else loops)
    for prompt in prompts(loops)[3:]:
        with torch.no_grad():
            hf.config.n_recurrent_loops = loops
            ref = hf(torch.tensor([prompt])).logits[0].float()
        got, depth = dense_forward(m, prompt, 1, loops, 1.0)
        assert torch.equal(depth, torch.full((len(prompt),), loops))
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)
        assert ref.std() > 0.5  # not a trivial (near-constant) model


@pytest.mark.parametrize("mode,top,block_size,tie", [
    ("per_loop", 4, 4, False), ("last_loop", 4, 4, False),
    ("per_loop", 3, 16, True), ("last_loop", 2, 1, True),
])
def test_paged_greedy_matches_transformers_generate(tmp_path_factory, mode, top, block_size, tie):
    """8 prompts of different lengths in one concurrent batch, per-request max_loops
    1..n_recurrent_loops; tokens == transformers generate (with that loop count)."""
    hf, m = models(tmp_path_factory, top, mode, tie)
    ps = prompts(100 + top)
    reqs = {f"r{i}": (p, 1, 1 + i % top, 1.0, i) for i, p in enumerate(ps)}
    out, logits = DoryDriver(m, block_size).generate(reqs, max_tokens=MAX_NEW)
    for rid, (prompt, _lo, hi, _thr, _seed) in reqs.items():
        ref, ref_logits = hf_generate(hf, prompt, hi)
        assert out[rid] == ref, (rid, hi)
        torch.testing.assert_close(torch.stack(logits[rid]), ref_logits, atol=1e-4, rtol=1e-4)
    hf.config.n_recurrent_loops = top


def test_dense_greedy_matches_transformers(tmp_path_factory):
    """The dense reference's last_loop piecewise semantics (prompt one piece, then token by
    token) reproduce transformers' generate."""
    hf, m = models(tmp_path_factory, 3, "last_loop")
    for prompt in prompts(7)[2:6:3]:
        toks, depths = dense_greedy_generate(m, prompt, 12, 1, 3, 1.0)
        ref, _ = hf_generate(hf, prompt, 3)
        assert toks == ref[:12] and set(depths) == {3}


def test_unsupported_architecture_lists_dory():
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*DoryForCausalLM"):
        parse_config({"architectures": ["GPT2LMHeadModel"]})


def test_doubled_config_parses(tmp_path_factory):
    """config.json as DoryConfig.to_dict() writes it (mlp entries, doubled counts)."""
    hf, m = models(tmp_path_factory, 2, "per_loop")
    cfg = parse_config(hf.config.to_dict() | {"architectures": ["DoryForCausalLM"]})
    assert cfg.layer_types == LAYER_TYPES and cfg.num_hidden_layers == 6
    assert (cfg.n_input_layers, cfg.n_recurrent_layers, cfg.n_output_layers) == (2, 2, 2)
    assert m.kv_spec.num_flat_layers == 4 and m.kv_spec.num_looped_layers == 2


def test_checkpoint_names_and_roundtrip(tmp_path):
    """Original two-block checkpoint names and save_pretrained names map to state_dict
    names; loopserve's own build/save/load round-trips."""
    from loopserve.model.dory import checkpoint_key
    from loopserve.model.registry import build_model, save_model

    assert checkpoint_key("backbone.layers.2.mixer.q_proj.weight") == "model.layers.1.self_attn.q_proj.weight"
    assert checkpoint_key("backbone.layers.3.mixer.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert checkpoint_key("backbone.layers.2.attn_alpha") == "model.layers.1.lambda_1"
    assert checkpoint_key("backbone.layers.3.mlp_alpha") == "model.layers.1.lambda_2"
    assert checkpoint_key("backbone.layers.1.self_attn.g_proj.weight") == "model.layers.1.self_attn.gate_proj.weight"
    assert checkpoint_key("backbone.embeddings.weight") == "model.embed_tokens.weight"
    assert checkpoint_key("lm_head.logit_scale") == "lm_head.logit_scale"
    cfg = parse_config(hf_config(2, "last_loop").to_dict() | {"architectures": ["DoryForCausalLM"]})
    m = build_model(cfg, seed=3)
    save_model(m, tmp_path)
    m2 = load_model(tmp_path)
    for k, v in m.state_dict().items():
        assert torch.equal(v, m2.state_dict()[k]), k
    assert m2.kv_planes(2) == 1 and m2.plane_of_depth(2) == 1


def test_hf_generate_keeps_prompt_tokens_equal_to_the_pad_id(tmp_path_factory):
    """The reference itself: a prompt token equal to generate's pad id (0) is a token, not
    padding (without an explicit mask, generate masked it and the first logits moved by ~1)."""
    hf, _ = models(tmp_path_factory, 1, "per_loop")
    prompt = next(p for p in prompts(3) if 0 in p[1:])
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0, -1].float()
    torch.testing.assert_close(hf_generate(hf, prompt, 1)[1][0], want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["per_loop", "last_loop"])
def test_engine_at_long_prompts_matches_dense_reference(tmp_path_factory, mode):
    """The engine (paged, batched, state slab) at prompts past every initial capacity
    (tests/real_shapes.py), both KV modes: the dense reference's greedy tokens."""
    from loopserve.engine.config import EngineConfig
    from loopserve.engine.engine_core import EngineCore
    from loopserve.protocol.sampling_params import SamplingParams
    from tests.engine.conftest import run_to_completion
    from tests.real_shapes import ENGINE, LONG_PROMPTS, prompt_of

    loops = 3
    _, m = models(tmp_path_factory, loops, mode)
    e = EngineCore(EngineConfig(model="dory", **ENGINE), model=m)
    lens = (LONG_PROMPTS[0], 9, LONG_PROMPTS[1])  # 2100 costs ~10x more here
    for n in lens:
        e.add_request(prompt_of(n), SamplingParams(max_tokens=4, ignore_eos=True, max_loops=loops - n % 2),
                      request_id=f"p{n}")
    outs, depths = run_to_completion(e)
    assert e.runner.states.version > 0
    for n in lens:
        hi = loops - n % 2
        toks, ref_depths = dense_greedy_generate(m, prompt_of(n), 4, 1, hi, 1.0)
        assert (outs[f"p{n}"], depths[f"p{n}"]) == (toks, ref_depths), n
