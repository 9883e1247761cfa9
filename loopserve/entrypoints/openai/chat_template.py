"""Chat messages to one prompt: the checkpoint's own chat template, or the one the server names.

A checkpoint's template is the `chat_template` of the `tokenizer_config.json` beside its
tokenizer file (Hugging Face's layout), a Jinja template rendered in a sandbox with
`messages`, `add_generation_prompt=True`, `bos_token` and `eos_token`, as transformers'
`apply_chat_template` does. `server.chat_template` (a Jinja file) replaces it, as vLLM's
`--chat-template` does. A model with neither has no chat template: it was not trained on
chat turns (the embedded models), so no prompt form would be one it knows, and
/v1/chat/completions refuses it (as vLLM does) rather than invent one.
"""

from __future__ import annotations

import json
from pathlib import Path

from loopserve.entrypoints.openai.protocol import ChatMessage


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._template = env.from_string(source)
        self._tokens = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, messages: list[ChatMessage]) -> str:
        msgs = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                for m in messages]
        return self._template.render(messages=msgs, add_generation_prompt=True, **self._tokens)


def _token_text(value: object) -> str:
    """tokenizer_config.json writes special tokens as strings or as {"content": ...}."""
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def load_chat_template(tokenizer_file: str | None, override: Path | None = None) -> ChatTemplate | None:
    """`override`'s template, else that of the checkpoint whose tokenizer is `tokenizer_file`
    (special tokens from its config either way), else None."""
    config_file = Path(tokenizer_file).parent / "tokenizer_config.json" if tokenizer_file else None
    config = json.loads(config_file.read_text()) if config_file and config_file.is_file() else {}
    source = override.read_text() if override is not None else config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        return None
    return ChatTemplate(source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))
