"""A worker's stats, typed: what it reports of itself (the `stats` RPC), read by the router,
the metrics and the fronts' introspection.

`healthy` is the explicit health field: the worker answered and its engine has not failed.
A worker that did not answer is `WorkerStats.unanswered(...)`: `engine` is None. The stats
cross processes as plain data: the worker sends `to_dict()`, the handle rebuilds them with
`from_dict`, so no launcher pickles these classes and a field added here is carried by both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class PoolUsage:
    used: int
    free: int
    total: int


@dataclass(frozen=True)
class SchedulerStats:
    num_waiting: int
    num_running: int
    num_receiving: int
    num_transferring: int
    num_slots: int
    num_pending: int
    num_inflight_batches: int
    num_preemptions: int
    num_finished: int
    num_aborted: int
    pending: dict[str, int] = field(default_factory=dict)  # "KIND/OPERATION" -> queued work


@dataclass
class EngineCounters:
    """What an engine has done since it started (the engine counts into it)."""

    tokens_generated: int = 0
    prompt_tokens: int = 0
    loops_run: int = 0  # rows x loops executed in RECURRENT batches
    batches: dict[str, int] = field(default_factory=lambda: {"PRELUDE": 0, "RECURRENT": 0, "CODA": 0})
    preemptions: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0


@dataclass(frozen=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up at admission
    hits: int = 0  # prompt tokens found cached
    cached_blocks: int = 0
    evicted_blocks: int = 0


@dataclass(frozen=True)
class EngineStats:
    looped: PoolUsage  # the looped layers' pool (every depth plane)
    flat: PoolUsage  # the non-looped layers' pool
    planes: tuple[int, ...]  # looped blocks held per KV plane
    scheduler: SchedulerStats
    counters: EngineCounters
    prefix_cache: PrefixCacheStats

    def pools(self) -> dict[str, PoolUsage]:
        return {"looped": self.looped, "flat": self.flat}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineStats:
        return cls(looped=PoolUsage(**d["looped"]), flat=PoolUsage(**d["flat"]), planes=tuple(d["planes"]),
                   scheduler=SchedulerStats(**d["scheduler"]), counters=EngineCounters(**d["counters"]),
                   prefix_cache=PrefixCacheStats(**d["prefix_cache"]))


@dataclass(frozen=True)
class PrefillStats:
    transferring: int  # handoffs whose KV awaits its reader
    leases_expired: int  # handoffs freed because their reader stopped renewing


@dataclass(frozen=True)
class KVReadStats:
    count: int = 0
    failed: int = 0  # failed or timed out
    bytes: int = 0
    seconds: float = 0.0  # READs posted to seen done
    fence_seconds: float = 0.0  # blocks given to the device having zeroed them, before each post


@dataclass(frozen=True)
class HandoffLatency:
    """A histogram: counts[i] latencies <= le[i] seconds; `count` and `sum` over all of them."""

    le: tuple[float, ...]
    counts: tuple[int, ...]
    count: int
    sum: float


@dataclass(frozen=True)
class DecodeStats:
    kv_reads: KVReadStats
    handoff_latency: HandoffLatency  # a handoff's arrival at the worker to its READ done
    inbox: int  # handoffs waiting for blocks
    reading: int  # placed handoffs: READs waiting for the zeroing of their blocks or in flight

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DecodeStats:
        h = d["handoff_latency"]
        return cls(KVReadStats(**d["kv_reads"]),
                   HandoffLatency(tuple(h["le"]), tuple(h["counts"]), h["count"], h["sum"]),
                   d["inbox"], d["reading"])


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    role: str
    healthy: bool  # answered, and its engine has not failed
    error: str | None = None  # why not healthy
    accepted: int = 0  # submit / submit_handoff calls accepted
    engine: EngineStats | None = None  # None: the worker did not answer
    prefill: PrefillStats | None = None  # a prefill worker's own
    decode: DecodeStats | None = None  # a decode worker's own

    @classmethod
    def unanswered(cls, worker_id: str, role: str, error: str) -> WorkerStats:
        return cls(worker_id, role, healthy=False, error=error)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> WorkerStats:
        engine, prefill, decode = d.get("engine"), d.get("prefill"), d.get("decode")
        return cls(**{**d, "engine": EngineStats.from_dict(engine) if engine else None,
                      "prefill": PrefillStats(**prefill) if prefill else None,
                      "decode": DecodeStats.from_dict(decode) if decode else None})
