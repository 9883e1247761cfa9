"""PrefixKeyer: how an engine names a prompt's full blocks in its prefix cache, as plain data.

The engine keys its cache with it; a router holding the same keyer (a worker hands it over:
`prefix_keyer()`) computes the same keys for a new request and routes it where its prefix is
cached, as the workers' KV events report (cluster/router/prefix_index.py). A key hashes the block's
tokens, its parent's key and what else a prompt token's K/V depends on: the model, dtype and
the request's resolved loop parameters and planes, and the seed for a seeded model.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loopserve.kv_cache import BlockHash, hash_blocks
from loopserve.protocol.sampling_params import SamplingParams


@dataclass(frozen=True)
class PrefixKeyer:
    model: str
    dtype: str
    kv_cache_dtype: str  # EngineConfig.kv_cache_dtype: an FP8 block is not a bf16 block
    block_size: int
    planes: tuple[int, ...]  # planes[m - 1]: looped KV planes of a request with max_loops m
    seeded: bool  # a prompt token's K/V depends on the request's seed

    def keys(self, token_ids: Sequence[int], params: SamplingParams,
             seed: int | None) -> tuple[BlockHash, ...] | None:
        """Keys of the prompt's full blocks for a request with resolved loop `params`; None
        when they depend on a seed not known yet (a seeded model, no seed given)."""
        if self.seeded and seed is None:
            return None
        p = params
        key = (self.model, self.dtype, self.kv_cache_dtype, p.min_loops, p.max_loops, p.exit_threshold,
               self.planes[p.max_loops - 1], (seed,) if self.seeded else ())
        return hash_blocks(token_ids, self.block_size, key)
