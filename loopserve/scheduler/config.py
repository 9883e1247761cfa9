"""Scheduler configuration, validated at construction (errors name the fields)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

POLICIES = ("refill", "no_refill", "priority", "mixed")


@dataclass(frozen=True)
class SpecConfig:
    num_draft_tokens: int = 3
    draft_loops: int = 1

    def __post_init__(self) -> None:
        if self.num_draft_tokens < 1:
            raise ValueError(f"speculative.num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        if self.draft_loops < 1:
            raise ValueError(f"speculative.draft_loops must be >= 1, got {self.draft_loops}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 512
    policy: Literal["refill", "no_refill", "priority", "mixed"] = "refill"
    split_prefill: bool = False
    prefill_chunk_size: int | None = None
    incremental_kv: bool = False
    preemption_mode: Literal["keep", "offload"] = "keep"
    speculative: SpecConfig | None = None
    role: Literal["colocated", "prefill", "decode"] = "colocated"
    coda_writes_kv: bool = True
    max_waiting: int = 4096
    admission_scan: int = 64  # waiting requests looked at per step
    admission_bypass: int = 8  # how many may be admitted past a blocked one

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.split_prefill:
            if self.prefill_chunk_size is None or self.prefill_chunk_size < 1:
                raise ValueError(f"split_prefill needs prefill_chunk_size >= 1, got {self.prefill_chunk_size}")
            if self.prefill_chunk_size > self.max_num_batched_tokens:
                raise ValueError(
                    f"prefill_chunk_size ({self.prefill_chunk_size}) must be <= "
                    f"max_num_batched_tokens ({self.max_num_batched_tokens})"
                )
        if self.policy == "mixed" and not self.split_prefill:
            raise ValueError("policy='mixed' requires split_prefill=True")
        if self.policy == "mixed" and self.speculative is not None:
            raise ValueError("policy='mixed' cannot be combined with speculative decoding")
        if self.preemption_mode not in ("keep", "offload"):
            raise ValueError(f"preemption_mode must be 'keep' or 'offload', got {self.preemption_mode!r}")
        if self.role not in ("colocated", "prefill", "decode"):
            raise ValueError(f"role must be colocated, prefill or decode, got {self.role!r}")
        if self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
