import json

import pytest
import torch
from hypothesis import example, given, settings, strategies as st
from safetensors.torch import load_file, save_file

from loopserve.model.config import MODEL_CONFIGS, load_model_config, parse_config
from loopserve.model.paged_kv import PagedKVCache
from loopserve.model.registry import MODEL_CLASSES, build_model, init_weights, load_model, resolve_model, save_model
from loopserve.model.tokenizer import ByteTokenizer


@pytest.mark.parametrize("name", ["tiny-huginn", "tiny-ouro"])
def test_safetensors_round_trip_with_public_keys(tmp_path, name):
    m = resolve_model(name, seed=3)
    save_model(m, tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    if name == "tiny-huginn":
        assert {"transformer.wte.weight", "transformer.adapter.weight", "transformer.ln_f.weight",
                "transformer.core_block.0.attn.Wqkv.weight", "transformer.core_block.1.mlp.fc.weight",
                "transformer.prelude.0.norm_4.weight", "transformer.coda.0.attn.proj.weight"} <= keys
        assert "lm_head.weight" not in keys  # tied to wte
    else:
        assert {"model.embed_tokens.weight", "model.layers.1.self_attn.q_proj.weight",
                "model.layers.0.input_layernorm_2.weight", "model.layers.0.post_attention_layernorm_2.weight",
                "model.layers.1.mlp.down_proj.weight", "model.norm.weight", "model.early_exit_gate.weight",
                "model.early_exit_gate.bias", "lm_head.weight"} <= keys
    back = load_model(tmp_path)
    for (k, a), (_, b) in zip(m.state_dict().items(), back.state_dict().items()):
        assert torch.equal(a, b), k


def _dory_config(tie: bool):
    from tests.model.test_dory import hf_config
    return parse_config(hf_config(2, "last_loop", tie=tie).to_dict() | {"architectures": ["DoryForCausalLM"]})


@pytest.mark.parametrize("cfg", [load_model_config("tiny-huginn"), load_model_config("tiny-ouro"),
                                 *(pytest.param(tie, id=f"dory-tie-{tie}") for tie in (False, True))])
def test_build_skips_torch_default_init_and_gives_the_same_model(cfg):
    """build_model allocates parameters without torch's default init (built on the meta device):
    every parameter and buffer equals a model constructed as usual and then seeded, and tied
    weights stay one tensor; a parameter the seeded init missed would differ here."""
    cfg = cfg if not isinstance(cfg, bool) else _dory_config(cfg)
    usual = MODEL_CLASSES[type(cfg)](cfg)
    init_weights(usual, seed=5)
    built = build_model(cfg, seed=5)
    assert not any(t.is_meta for t in [*built.parameters(), *built.buffers()])
    want = dict(usual.named_parameters(remove_duplicate=False)) | dict(usual.named_buffers())
    got = dict(built.named_parameters(remove_duplicate=False)) | dict(built.named_buffers())
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    shared = lambda m: sorted(n for n, _ in m.named_parameters(remove_duplicate=False)  # noqa: E731
                              if n not in dict(m.named_parameters()))
    assert shared(built) == shared(usual)


def test_sharded_checkpoint_loads(tmp_path):
    m = resolve_model("tiny-ouro", seed=1)
    save_model(m, tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    (tmp_path / "model.safetensors").unlink()
    names = sorted(tensors)
    half = len(names) // 2
    save_file({k: tensors[k] for k in names[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({k: tensors[k] for k in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    wm = {k: ("model-00001-of-00002.safetensors" if i < half else "model-00002-of-00002.safetensors")
          for i, k in enumerate(names)}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    back = load_model(tmp_path)
    assert torch.equal(back.lm_head.weight, m.lm_head.weight)


def test_bad_checkpoint_names_the_tensor(tmp_path):
    m = resolve_model("tiny-ouro")
    save_model(m, tmp_path)
    t = load_file(str(tmp_path / "model.safetensors"))
    t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.up_proj\.weight.*\(3, 3\)"):
        load_model(tmp_path)
    del t["model.layers.0.mlp.up_proj.weight"]
    save_file(t, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="missing tensor 'model.layers.0.mlp.up_proj.weight'"):
        load_model(tmp_path)


def test_config_errors_name_field_value_and_range():
    base = json.loads((MODEL_CONFIGS / "tiny-ouro.json").read_text())
    with pytest.raises(ValueError, match=r"hidden_size=0.*greater than or equal to 1"):
        parse_config({**base, "hidden_size": 0})
    with pytest.raises(ValueError, match="intermediate_size"):
        parse_config({k: v for k, v in base.items() if k != "intermediate_size"})
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'.*OuroForCausalLM"):
        parse_config({**base, "architectures": ["GPT2LMHeadModel"]})
    with pytest.raises(ValueError, match="early_exit_threshold"):
        parse_config({**base, "early_exit_threshold": 1.5})
    with pytest.raises(ValueError, match="neither a directory nor one of"):
        load_model_config("no-such-model")


def test_public_shapes_parse():
    h = load_model_config("huginn-0125-shape")
    assert (h.head_dim, h.kv_heads, h.loop_max) == (96, 55, 32)
    o = load_model_config("ouro-1.4b-shape")
    assert (o.hd, o.loop_max, o.early_exit_threshold) == (128, 4, 1.0)


def test_released_blocks_expose_no_old_data():
    m = resolve_model("tiny-huginn")
    kv = PagedKVCache(m.kv_spec, 4, 8, 4, torch.float32, torch.device("cpu"))
    kv.looped.fill_(7.0)
    kv.flat.fill_(7.0)
    kv.zero_blocks("looped", [1, 3])
    kv.zero_blocks("flat", [2])
    assert kv.looped[[1, 3]].abs().sum() == 0 and kv.looped[0].abs().sum() > 0
    assert kv.flat[2].abs().sum() == 0


@settings(max_examples=100, deadline=None)
@given(ids=st.lists(st.integers(0, 39), max_size=40))
@example(ids=list(range(5, 30)) + [33, 34])  # two runs: memsets
@example(ids=list(range(0, 40, 2)))  # 20 runs: one index_fill
def test_zero_blocks_zeroes_exactly_the_given_blocks_as_runs_or_one_index_fill(ids):
    from loopserve.model import paged_kv

    m = resolve_model("tiny-ouro")
    kv = PagedKVCache(m.kv_spec, 4, 40, 0, torch.float32, torch.device("cpu"))
    kv.looped.fill_(7.0)
    kv.zero_blocks("looped", ids)
    zeroed = (kv.looped.flatten(1) == 0).all(1)
    assert zeroed.tolist() == [b in set(ids) for b in range(40)]
    assert (kv.looped.flatten(1) == 7.0).all(1).tolist() == [b not in set(ids) for b in range(40)]
    runs = paged_kv._runs(ids, 1000)
    assert [b for a, e in runs for b in range(a, e)] == sorted(set(ids))  # runs cover the ids, in order
    assert all(e1 < a2 for (_, e1), (a2, _) in zip(runs, runs[1:]))  # maximal: no touching runs


@pytest.mark.parametrize("chunk_slots", [1, 3, 1000])
def test_copy_slots_looped_in_chunks_copies_every_slot(chunk_slots, monkeypatch):
    """The last-exited fill copies in chunks of bounded bytes (a 4K prompt's fill once took
    4.37 GiB at once and ran a GPU out of memory): every chunking gives the one-shot result."""
    from loopserve.model import paged_kv

    m = resolve_model("tiny-ouro")
    kv = PagedKVCache(m.kv_spec, 4, 24, 0, torch.float32, torch.device("cpu"))
    kv.looped.copy_(torch.randn_like(kv.looped))
    slot_bytes = kv.looped[0, :, :, 0].numel() * kv.looped.element_size()
    monkeypatch.setattr(paged_kv, "_COPY_CHUNK_BYTES", chunk_slots * slot_bytes)
    src = torch.tensor([s for s in range(0, 32) for _ in range(2)])  # blocks 0-7: one plane
    dst = torch.tensor([d for s in range(0, 32) for d in (s + 32, s + 64)])  # two deeper ones
    want = kv.looped.clone()
    for s, d in zip(src.tolist(), dst.tolist()):
        want[d // 4, :, :, d % 4] = want[s // 4, :, :, s % 4]
    kv.copy_slots_looped(src, dst)
    assert torch.equal(kv.looped, want)


def test_byte_tokenizer_round_trip_and_incremental_utf8():
    tok = ByteTokenizer()
    text = "héllo wörld — ✓ 你好"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    detok = tok.detokenizer()
    pieces = [detok.add(i) for i in ids]
    assert "".join(pieces) == text
    assert "" in pieces  # a multi-byte character was held back until complete
    assert detok.add(tok.eos_token_id) == ""


def test_a_3k_prompt_exiting_early_decodes_the_same_with_its_fill_in_chunks(monkeypatch):
    """The shape that ran an H100 out of memory: a 3000-token prompt exiting at loop 2 of 4
    fills two deeper planes for every position at once; in 64-slot chunks the engine gives the
    same tokens and exit depths."""
    from loopserve.engine.config import EngineConfig
    from loopserve.engine.engine_core import EngineCore
    from loopserve.model import paged_kv
    from loopserve.protocol.sampling_params import SamplingParams

    prompt = [(j * 37) % 250 + 3 for j in range(3000)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, exit_threshold=0.6)

    def run() -> tuple[list[int], list[int]]:
        e = EngineCore(EngineConfig(model="tiny-ouro", max_model_len=4096, num_blocks=1200))
        e.add_request(prompt, params, request_id="r")
        tokens, depths = [], []
        while e.has_unfinished():
            for o in e.step():
                tokens += o.new_token_ids
                depths += o.exit_depths
        return tokens, depths

    whole = run()
    slot_bytes = PagedKVCache(resolve_model("tiny-ouro").kv_spec, 16, 1, 0, torch.float32,
                              torch.device("cpu")).looped[0, :, :, 0].numel() * 4
    calls = []
    real = PagedKVCache.copy_slots_looped
    monkeypatch.setattr(PagedKVCache, "copy_slots_looped", lambda self, s, d: calls.append(len(s)) or real(self, s, d))
    monkeypatch.setattr(paged_kv, "_COPY_CHUNK_BYTES", 64 * slot_bytes)
    assert run() == whole
    assert max(calls) > 64 * 10  # the prompt's fill took many chunks
    assert min(whole[1]) < 4  # tokens exited early: deeper planes were filled
