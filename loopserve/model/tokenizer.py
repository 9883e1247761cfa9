"""Tokenizers: the embedded byte-level default, or a `tokenizers` JSON file (by default the
`tokenizer.json` of a Hugging Face checkpoint directory, with the EOS its configs name)."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

# EOS spellings tried when no config beside the tokenizer names one.
EOS_NAMES = ("</s>", "<|endoftext|>", "<|im_end|>", "<eos>")


class _ByteDetokenizer:
    """Incremental: yields text deltas, holding back an incomplete UTF-8 sequence."""

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def add(self, token_id: int) -> str:
        return self._dec.decode(bytes([token_id])) if token_id < 256 else ""


class ByteTokenizer:
    """ids 0..255 are bytes; then bos, eos, pad."""

    bos_token_id, eos_token_id, pad_token_id = 256, 257, 258
    min_vocab = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")

    def detokenizer(self) -> _ByteDetokenizer:
        return _ByteDetokenizer()


class _HFDetokenizer:
    def __init__(self, tok) -> None:
        self._tok, self._ids, self._text = tok, [], ""

    def add(self, token_id: int) -> str:
        self._ids.append(token_id)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):  # incomplete multi-byte sequence: wait for more
            return ""
        delta, self._text = text[len(self._text):], text
        return delta


def _config_eos(directory: Path, tok) -> int | None:
    """The EOS id the checkpoint's configs name: tokenizer_config.json's `eos_token`, else
    config.json's `eos_token_id` (the first, if a list)."""
    tc = directory / "tokenizer_config.json"
    if tc.is_file():
        eos = json.loads(tc.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tok.token_to_id(eos) is not None:
            return tok.token_to_id(eos)
    mc = directory / "config.json"
    if mc.is_file():
        eos = json.loads(mc.read_text()).get("eos_token_id")
        eos = eos[0] if isinstance(eos, list) and eos else eos
        if isinstance(eos, int):
            return eos
    return None


class HFTokenizer:
    def __init__(self, path: str | Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))
        self.min_vocab = self._tok.get_vocab_size()
        eos = _config_eos(Path(path).parent, self._tok)
        self.eos_token_id = eos if eos is not None else next(
            (self._tok.token_to_id(t) for t in EOS_NAMES if self._tok.token_to_id(t) is not None), None)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids)

    def detokenizer(self) -> _HFDetokenizer:
        return _HFDetokenizer(self._tok)


def tokenizer_file(tokenizer: str | None, model: str) -> str | None:
    """The tokenizer an engine uses: `tokenizer` if set, else the model directory's
    tokenizer.json, else None (the byte tokenizer: the embedded models)."""
    if tokenizer is not None:
        return tokenizer
    candidate = Path(model) / "tokenizer.json"
    return str(candidate) if candidate.is_file() else None


def load_tokenizer(path: str | Path | None, vocab_size: int | None = None):
    """The byte tokenizer (path None) or a tokenizer.json; checked against the model's
    vocab_size when given."""
    tok = ByteTokenizer() if path is None else HFTokenizer(path)
    if vocab_size is not None and vocab_size < tok.min_vocab:
        raise ValueError(f"model vocab_size ({vocab_size}) is smaller than the tokenizer's ({tok.min_vocab})")
    return tok
