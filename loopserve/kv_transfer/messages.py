"""The one message that crosses from a prefill engine to a decode engine besides KV blocks."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class HandoffMessage:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the first token, sampled on the prefill side
    exit_depths: list[int]  # loop depth each position with KV exited at (prompt + first producer)
    params: dict  # SamplingParams.to_dict(), loop fields resolved
    seed: int  # sampling RNG state = (seed, draw index = len(output_token_ids))
    block_table: dict  # the prefill side's BlockTable.to_dict()
    num_kv_tokens: int  # positions whose KV is complete on every plane
    arrival_time: float
    first_token_time: float | None
    prefill_engine_id: str = ""  # whose NIXL agent holds the blocks
    compat: dict = field(default_factory=dict)  # the prefill engine's kv_compat()

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> HandoffMessage:
        return cls(**d)
