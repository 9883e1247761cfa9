"""A Hugging Face checkpoint directory's own tokenizer.json (trained here with `tokenizers`),
with the EOS its tokenizer_config.json names, is what the engine and `loopserve generate
--model DIR` use; a directory with only config.json is refused (random weights are asked for
by an embedded config name or the config.json file itself)."""

from __future__ import annotations

import json

import pytest
import torch

from loopserve.cli import main
from loopserve.engine.llm import LLM
from loopserve.model.config import parse_config
from loopserve.model.registry import build_model, resolve_model, save_model
from loopserve.model.tokenizer import HFTokenizer
from loopserve.protocol.sampling_params import SamplingParams

TEXTS = ["the cat sat on the mat", "a dog ran to the cat", "the mat was red and the dog sat"]


def dory_config(vocab_size: int) -> dict:
    return dict(architectures=["DoryForCausalLM"], vocab_size=vocab_size, hidden_size=32,
                intermediate_size=64, num_hidden_layers=3, num_attention_heads=2,
                num_key_value_heads=1, head_dim=16, n_input_layers=1, n_recurrent_layers=1,
                n_output_layers=1, n_recurrent_loops=2, recurrent_kv_cache_mode="per_loop",
                max_position_embeddings=256)


def save_checkpoint(d, chat_template: str | None = None):
    """A Dory checkpoint with a word-level tokenizer trained on TEXTS; returns the tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(TEXTS, trainers.WordLevelTrainer(special_tokens=["[UNK]", "[EOS]"]))
    save_model(build_model(parse_config(dory_config(tok.get_vocab_size())), seed=1), d)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "[EOS]", **({"chat_template": chat_template} if chat_template else {})}))
    return tok


def test_the_directory_tokenizer_round_trips_text(tmp_path):
    tok = save_checkpoint(tmp_path)
    llm = LLM(model=str(tmp_path))
    assert isinstance(llm.engine.tokenizer, HFTokenizer)
    assert llm.engine.tokenizer.eos_token_id == tok.token_to_id("[EOS]")
    out = llm.generate(["the dog sat"], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert out.prompt_token_ids == tok.encode("the dog sat").ids
    assert len(out.token_ids) == 6 and out.text == tok.decode(out.token_ids) and out.text


def test_generate_cli_uses_the_directory_tokenizer(tmp_path, capsys):
    tok = save_checkpoint(tmp_path)
    assert main(["generate", "the cat ran", "--model", str(tmp_path), "--max-tokens", "5", "--json"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # text -> the trained tokenizer's ids (every word known: no [UNK]) -> model -> ids -> text
    assert out["prompt_token_ids"] == tok.encode("the cat ran").ids
    assert tok.token_to_id("[UNK]") not in out["prompt_token_ids"]
    assert out["token_ids"] and out["text"] == tok.decode(out["token_ids"])
    assert set(out["text"].split()) <= set(tok.get_vocab())


def test_a_directory_without_weights_is_refused(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(dory_config(64)))
    with pytest.raises(ValueError, match=r"no weights: looked for model.safetensors.index.json "
                                         r"and \*.safetensors, found \['config.json'\]"):
        resolve_model(tmp_path)
    assert main(["generate", "hi", "--model", str(tmp_path), "--max-tokens", "2"]) != 0
    assert "no weights" in capsys.readouterr().err


def test_random_weights_are_asked_for_by_name_or_config_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dory_config(64)))
    a, b = resolve_model(tmp_path / "config.json", seed=2), resolve_model(tmp_path / "config.json", seed=2)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert resolve_model("tiny-ouro") is not None
