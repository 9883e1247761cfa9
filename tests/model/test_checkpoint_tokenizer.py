"""A Hugging Face checkpoint directory's own tokenizer.json (trained here with `tokenizers`),
with the EOS its tokenizer_config.json names, is what the engine and `loopserve generate
--model DIR` use; a directory with only config.json says loudly that its weights are random."""

from __future__ import annotations

import json
import logging

from loopserve.cli import main
from loopserve.engine.llm import LLM
from loopserve.engine.sampling_params import SamplingParams
from loopserve.model.config import parse_config
from loopserve.model.registry import build_model, resolve_model, save_model
from loopserve.model.tokenizer import HFTokenizer

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
    assert out["token_ids"] and out["text"] == tok.decode(out["token_ids"])
    assert set(out["text"].split()) <= set(tok.get_vocab())


def test_a_directory_without_weights_warns_they_are_random(tmp_path, caplog):
    (tmp_path / "config.json").write_text(json.dumps(dory_config(64)))
    with caplog.at_level(logging.WARNING):
        resolve_model(tmp_path)
    assert "RANDOMLY INITIALISED" in caplog.text and "no *.safetensors" in caplog.text


def test_a_named_model_does_not_warn(caplog):
    with caplog.at_level(logging.WARNING):
        resolve_model("tiny-ouro")
    assert "RANDOMLY" not in caplog.text
