"""What a prefill engine hands a decode engine besides the KV blocks themselves."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class HandoffState:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the first token, sampled on the prefill side
    exit_depths: list[int]  # exit depth of every position that has KV (+ the first token's producer)
    params: dict  # SamplingParams.to_dict(), loop fields resolved
    seed: int  # sampling RNG state is (seed, draw index = len(output_token_ids))
    block_table: dict  # the prefill side's BlockTable.to_dict()
    num_kv_tokens: int  # positions whose KV is complete on every plane
    arrival_time: float
    first_token_time: float | None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> HandoffState:
        return cls(**d)
