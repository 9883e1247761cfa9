"""Scheduler configuration, validated at construction so a bad combination never schedules.

EngineConfig embeds SchedulerConfig as `scheduler`; these defaults are the engine's.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from loopserve.scheduler.policy import POLICIES


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SpeculativeConfig(_Frozen):
    """Self-speculation by depth: draft `num_draft_tokens` at `draft_loops`, verify at full depth."""

    num_draft_tokens: int = Field(3, ge=1, le=16)
    draft_loops: int = Field(1, ge=1)


class SchedulerConfig(_Frozen):
    max_num_seqs: int = Field(32, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1)
    policy: str = "refill"  # a name in policy.POLICIES
    split_prefill: bool = False
    prefill_chunk_size: int | None = Field(None, ge=1)  # split prefill default: min(256, max_num_batched_tokens)
    incremental_kv: bool = False
    preemption_mode: Literal["keep", "offload"] = "keep"  # how priority victims yield their slot
    speculative: SpeculativeConfig | None = None
    role: Literal["colocated", "prefill", "decode"] = "colocated"
    # Huginn: every prompt chunk needs a CODA; Ouro: only the last. A fact of the model that
    # the engine fills in, not a setting: no dump carries it.
    coda_writes_kv: bool = Field(True, exclude=True)
    max_waiting: int = Field(4096, ge=1)
    # Ready work waits at most this many schedule steps for a wider batch of its group
    # (docs/scheduler.md: policies and selection order).
    max_wait_steps: int = Field(12, ge=1)

    @field_validator("policy")
    @classmethod
    def _registered(cls, policy: str) -> str:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}; got {policy!r}")
        return policy

    @model_validator(mode="after")
    def _check(self) -> SchedulerConfig:
        if self.prefill_chunk_size is not None:
            if not self.split_prefill:
                raise ValueError(f"prefill_chunk_size={self.prefill_chunk_size} needs split_prefill=True")
            if self.prefill_chunk_size > self.max_num_batched_tokens:
                raise ValueError(
                    f"prefill_chunk_size ({self.prefill_chunk_size}) must be <= "
                    f"max_num_batched_tokens ({self.max_num_batched_tokens})"
                )
        elif self.split_prefill:  # frozen: the computed default is set once, here
            object.__setattr__(self, "prefill_chunk_size", min(256, self.max_num_batched_tokens))
        policy = POLICIES[self.policy]
        if policy.needs_split_prefill and not self.split_prefill:
            raise ValueError(f"policy={self.policy!r} requires split_prefill=True (got split_prefill=False)")
        if self.speculative is not None:
            if not policy.supports_speculation:
                raise ValueError(
                    f"speculative decoding is not supported with policy={self.policy!r} "
                    "(set speculative=None or choose another policy)"
                )
            # A verify round runs its num_draft_tokens rows in one batch; more never fit and
            # the request would wait forever.
            if self.speculative.num_draft_tokens > self.max_num_batched_tokens:
                raise ValueError(
                    f"speculative.num_draft_tokens ({self.speculative.num_draft_tokens}) must be <= "
                    f"max_num_batched_tokens ({self.max_num_batched_tokens})"
                )
        return self
