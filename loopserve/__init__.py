"""loopserve: serving looped transformer LMs with prefill/decode disaggregation."""

from __future__ import annotations

__all__ = ["LLM", "AsyncLLM", "SamplingParams", "EngineConfig"]


def __getattr__(name: str):
    # Lazy: `import loopserve.scheduler` must not pull in torch.
    if name in ("LLM", "AsyncLLM"):
        from loopserve.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from loopserve.protocol.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from loopserve.engine.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
