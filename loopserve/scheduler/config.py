"""Scheduler configuration, validated at construction so a bad combination never schedules."""

from __future__ import annotations

from dataclasses import dataclass

from loopserve.scheduler.policy import POLICIES

PREEMPTION_MODES = ("keep", "offload")
ROLES = ("colocated", "prefill", "decode")


def _need_int(name: str, value: object, low: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _need_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}")


@dataclass(frozen=True)
class SpecConfig:
    """Self-speculation by depth: draft `num_draft_tokens` at `draft_loops`, verify at full depth."""

    num_draft_tokens: int = 3
    draft_loops: int = 1

    def __post_init__(self) -> None:
        _need_int("speculative.num_draft_tokens", self.num_draft_tokens, 1)
        _need_int("speculative.draft_loops", self.draft_loops, 1)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    policy: str = "refill"
    split_prefill: bool = False
    prefill_chunk_size: int | None = None  # split prefill default: min(256, max_num_batched_tokens)
    incremental_kv: bool = False
    preemption_mode: str = "keep"  # how priority victims yield their slot
    speculative: SpecConfig | None = None
    role: str = "colocated"
    coda_writes_kv: bool = True  # Huginn: every prompt chunk needs a CODA; Ouro: only the last
    max_waiting: int = 4096

    def __post_init__(self) -> None:
        _need_int("max_num_seqs", self.max_num_seqs, 1)
        _need_int("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _need_int("max_waiting", self.max_waiting, 1)
        _need_choice("policy", self.policy, tuple(POLICIES))
        _need_choice("preemption_mode", self.preemption_mode, PREEMPTION_MODES)
        _need_choice("role", self.role, ROLES)
        if self.prefill_chunk_size is not None:
            if not self.split_prefill:
                raise ValueError(
                    f"prefill_chunk_size={self.prefill_chunk_size} needs split_prefill=True"
                )
            _need_int("prefill_chunk_size", self.prefill_chunk_size, 1)
            if self.prefill_chunk_size > self.max_num_batched_tokens:
                raise ValueError(
                    f"prefill_chunk_size ({self.prefill_chunk_size}) must be <= "
                    f"max_num_batched_tokens ({self.max_num_batched_tokens})"
                )
        elif self.split_prefill:
            object.__setattr__(self, "prefill_chunk_size", min(256, self.max_num_batched_tokens))
        policy = POLICIES[self.policy]
        if policy.needs_split_prefill and not self.split_prefill:
            raise ValueError(f"policy={self.policy!r} requires split_prefill=True (got split_prefill=False)")
        if self.speculative is not None:
            if not isinstance(self.speculative, SpecConfig):
                raise ValueError(f"speculative must be a SpecConfig or None, got {self.speculative!r}")
            if not policy.supports_speculation:
                raise ValueError(
                    f"speculative decoding is not supported with policy={self.policy!r} "
                    "(set speculative=None or choose another policy)"
                )
