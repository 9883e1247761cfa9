"""Chat messages to one prompt: the checkpoint's own chat template, else a documented default.

A checkpoint's template is the `chat_template` of the `tokenizer_config.json` beside its
tokenizer file (Hugging Face's layout), a Jinja template rendered in a sandbox with
`messages`, `add_generation_prompt=True`, `bos_token` and `eos_token`, as transformers'
`apply_chat_template` does. Without one (the embedded models: byte tokenizer) the default is

    <|system|>\\n{content}\\n<|user|>\\n{content}\\n<|assistant|>\\n{content}\\n ... <|assistant|>\\n

one block per message in order, then the assistant's header for the reply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

from loopserve.entrypoints.openai.protocol import ChatMessage


class ChatTemplate(Protocol):
    def render(self, messages: list[ChatMessage]) -> str: ...


class DefaultChatTemplate:
    def render(self, messages: list[ChatMessage]) -> str:
        return "".join(f"<|{m.role}|>\n{m.text()}\n" for m in messages) + "<|assistant|>\n"


class JinjaChatTemplate:
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


def load_chat_template(tokenizer_file: str | None) -> ChatTemplate:
    """The template of the checkpoint whose tokenizer is `tokenizer_file`, else the default."""
    if tokenizer_file is None:
        return DefaultChatTemplate()
    config_file = Path(tokenizer_file).parent / "tokenizer_config.json"
    if not config_file.is_file():
        return DefaultChatTemplate()
    config = json.loads(config_file.read_text())
    source = config.get("chat_template")
    if isinstance(source, list):  # named templates: [{"name": "default", "template": ...}, ...]
        source = next((t.get("template") for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
        return DefaultChatTemplate()
    return JinjaChatTemplate(source, _token_text(config.get("bos_token")),
                             _token_text(config.get("eos_token")))
