"""Building schedulers and requests for the scheduler tests."""

from __future__ import annotations

from loopserve.kv_cache import KVCacheManager, KVLayout, hash_blocks
from loopserve.scheduler import Scheduler, SchedulerConfig, SchedRequest, SpeculativeConfig
from tests.scheduler.fake_engine import FakeEngine

# One entry per policy (and the variants that change its work shapes).
POLICY_CONFIGS: dict[str, dict] = {
    "refill": {},
    "no_refill": {"policy": "no_refill"},
    "priority": {"policy": "priority"},
    "priority-offload": {"policy": "priority", "preemption_mode": "offload"},
    "mixed": {"policy": "mixed", "split_prefill": True, "prefill_chunk_size": 4},
    "split-ouro": {"split_prefill": True, "prefill_chunk_size": 3, "coda_writes_kv": False},
    "speculative": {"speculative": SpeculativeConfig(num_draft_tokens=3, draft_loops=1)},
}


def make_scheduler(blocks: int = 200, block_size: int = 2, flat: bool = True,
                   incremental: bool = False, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 512, **cfg) -> Scheduler:
    """Smaller slot and token budgets than the engine's defaults, so the tests' few requests
    contend for them."""
    layout = KVLayout(block_size, blocks, blocks if flat else 0, flat)
    kv = KVCacheManager(layout, incremental=incremental)
    return Scheduler(SchedulerConfig(incremental_kv=incremental, max_num_seqs=max_num_seqs,
                                     max_num_batched_tokens=max_num_batched_tokens, **cfg), kv)


def add(engine: FakeEngine, i: int | str, prompt_len: int = 5, max_tokens: int = 4,
        min_loops: int = 1, max_loops: int = 3, priority: int = 0, greedy: bool = True,
        num_planes: int | None = None, prompt: int | None = None) -> str:
    """`prompt`: prefix caching on, the prompt's tokens all `prompt` (equal values share prefixes)."""
    rid = i if isinstance(i, str) else f"r{i}"
    keys = None
    if prompt is not None:
        keys = hash_blocks([prompt] * prompt_len, engine.bs, (min_loops, max_loops, num_planes))
        engine.keys[rid] = keys
    engine.sched.add_request(SchedRequest(rid, prompt_len, max_tokens, min_loops, max_loops,
                                          priority=priority, greedy=greedy, num_planes=num_planes,
                                          block_hashes=keys))
    engine.track(rid, prompt_len, max_tokens, min_loops, max_loops)
    return rid


def engine_for(seed: int = 0, finish_p: float = 0.0, max_lag: int = 1, **kw) -> FakeEngine:
    return FakeEngine(make_scheduler(**kw), seed=seed, finish_p=finish_p, max_lag=max_lag)
