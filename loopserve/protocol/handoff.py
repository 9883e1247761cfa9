"""The handoff: the one message that crosses from a prefill engine to a decode engine besides
KV blocks, as plain data (the engine packs and unpacks it: `engine/handoff.py`).

Workers and the router carry it (pickled by Ray or the process launcher) and read its size;
it lives here, torch-free, so they need not load the engine to do so. It is validated on
construction: a malformed handoff fails where it is made or received, not halfway through a
decode step. `to_dict` / `from_dict` give its plain-types form for a transport that does
not pickle.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from loopserve.intmath import cdiv
from loopserve.kv_cache import BlockTable
from loopserve.protocol.sampling_params import SamplingParams

_LOOP_KEYS = ("min_loops", "max_loops", "exit_threshold")


def compat_hash(compat: dict) -> str:
    """A short stable digest of an engine's KV compatibility info (key order does not matter)."""
    blob = json.dumps(compat, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


@dataclass
class HandoffMessage:
    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]  # sampled on the prefill side (the first token)
    exit_depths: list[int]  # loop depth each position with KV exited at (prompt, then outputs)
    params: SamplingParams  # loop fields resolved
    seed: int  # sampling RNG state is (seed, num_draws): draws are counter based
    block_table: dict  # the prefill side's BlockTable.to_dict()
    num_kv_tokens: int  # positions whose KV is complete on every plane
    arrival_time: float
    first_token_time: float | None
    prefill_engine_id: str = ""  # whose NIXL agent holds the blocks; set by the prefill worker
    compat: dict = field(default_factory=dict)  # the prefill engine's kv_compat()

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"HandoffMessage.request_id must be a non-empty string, got {self.request_id!r}")
        where = f"HandoffMessage {self.request_id!r}"
        if not self.output_token_ids:
            raise ValueError(f"{where}: output_token_ids must hold the first token, got []")
        total = len(self.prompt_token_ids) + len(self.output_token_ids)
        if not 1 <= self.num_kv_tokens <= total:
            raise ValueError(f"{where}: num_kv_tokens must be in [1, {total}] (prompt + outputs), "
                             f"got {self.num_kv_tokens}")
        if not self.num_kv_tokens <= len(self.exit_depths) <= total:
            raise ValueError(f"{where}: exit_depths must cover the {self.num_kv_tokens} positions with KV "
                             f"and at most {total}, got {len(self.exit_depths)}")
        if not isinstance(self.params, SamplingParams):
            raise ValueError(f"{where}: params must be SamplingParams, got {type(self.params).__name__}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"{where}: seed must be an integer in [0, 2**63), got {self.seed!r}")
        if not isinstance(self.compat.get("block_size"), int) or self.compat["block_size"] < 1:
            raise ValueError(f"{where}: compat['block_size'] must be an integer >= 1, "
                             f"got {self.compat.get('block_size')!r}")
        table = self.table()
        need = cdiv(self.num_kv_tokens, self.block_size)
        if not table.depth:
            raise ValueError(f"{where}: block_table has no depth planes")
        planes = {f"depth[{d}]": ids for d, ids in enumerate(table.depth)}
        if table.flat:  # empty when the model has no non-looped layers
            planes["flat"] = table.flat
        for name, ids in planes.items():
            if len(ids) < need:
                raise ValueError(f"{where}: block_table {name} has {len(ids)} blocks, fewer than the "
                                 f"{need} that {self.num_kv_tokens} tokens need at block_size {self.block_size}")

    @property
    def block_size(self) -> int:
        return self.compat["block_size"]

    @property
    def num_draws(self) -> int:
        """Sampler draws so far: one per output token (seeded by (seed, output index))."""
        return len(self.output_token_ids)

    @property
    def loop_params(self) -> dict:
        return {k: getattr(self.params, k) for k in _LOOP_KEYS}

    @property
    def compat_hash(self) -> str:
        return compat_hash(self.compat)

    def looped_blocks(self) -> int:
        """Looped blocks a decode engine reserves for it: prompt + max_tokens on every plane
        the prefill side's block table has (one for a model whose loops share a plane)."""
        tokens = len(self.prompt_token_ids) + self.params.max_tokens
        return cdiv(tokens, self.block_size) * self.table().num_planes

    def table(self) -> BlockTable:
        try:
            return BlockTable.from_dict(self.block_table)
        except (KeyError, TypeError) as e:
            raise ValueError(f"HandoffMessage {self.request_id!r}: block_table must be "
                             f"{{'flat': [...], 'depth': [[...], ...]}}, got {self.block_table!r}") from e

    def to_dict(self) -> dict:
        return {**asdict(self), "params": self.params.to_dict()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HandoffMessage:
        names = {f.name for f in fields(cls)}
        if unknown := sorted(set(d) - names):
            raise ValueError(f"HandoffMessage: unknown fields {unknown}")
        required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
        if missing := sorted(required - set(d)):
            raise ValueError(f"HandoffMessage: missing fields {missing}")
        return cls(**{**d, "params": SamplingParams.from_dict(d["params"])})
