"""EngineCounters: what an engine has done since it started (its stats() reports them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class EngineCounters:
    tokens_generated: int = 0
    prompt_tokens: int = 0
    loops_run: int = 0  # rows x loops executed in RECURRENT batches
    batches: dict[str, int] = field(default_factory=lambda: {"PRELUDE": 0, "RECURRENT": 0, "CODA": 0})
    preemptions: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
