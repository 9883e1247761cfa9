"""Prefix caching (issue 29): greedy outputs and exit depths are the same with and without it,
for every policy, preemption with offload, speculation, Dory and PD; cached prompt work is
skipped (all loops of it) and counted; idle engines hold only free or cached blocks."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from loopserve.protocol.sampling_params import SamplingParams
from loopserve.protocol.stats import PrefixCacheStats
from tests.engine.conftest import make_engine, run_pd, run_to_completion
from tests.engine.test_equivalence import CONFIGS

BS = 4  # make_engine's block size


def shared_prefix_workload(prefix_len: int = 20, n: int = 14, seed: int = 0, max_tokens: int = 8):
    """Three groups over two system prompts: A with one loop setting, A with another (same
    tokens, other key: must not hit), B. User turns of 0..11 tokens; one prompt is exactly A
    (fully cached but for its last token). Huginn's seeded state: one seed per group."""
    rng = random.Random(seed)
    a, b = ([rng.randrange(0, 256) for _ in range(prefix_len)] for _ in range(2))
    groups = [(a, dict(min_loops=1, max_loops=None, exit_threshold=0.7)),
              (a, dict(min_loops=2, max_loops=3, exit_threshold=1.0)),
              (b, dict(min_loops=1, max_loops=4, exit_threshold=0.9))]
    out = []
    for i in range(n):
        g = i % 3
        prefix, loops = groups[g]
        user = [] if i == 3 else [rng.randrange(0, 256) for _ in range(rng.choice([1, 3, 6, 11]))]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=g, **loops)
        out.append((f"r{i}", prefix + user, params))
    return out


def serve(family, work, caching: bool, first: int = 4, **cfg):
    engine = make_engine(family, enable_prefix_caching=caching, **cfg)
    for rid, prompt, params in work[:first]:
        engine.add_request(prompt, params, request_id=rid)
    outs, depths = run_to_completion(engine, arrivals=work[first:])
    assert engine.kv_manager.usage().used_blocks == 0  # every block free or cached, unreferenced
    return engine, outs, depths


@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_same_outputs_with_and_without_caching(family, cfg):
    work = shared_prefix_workload()
    if "priority" in cfg or "preempt" in cfg:  # later arrivals are more important: preemption
        work = [(rid, prompt, replace(p, priority=-int(rid[1:]))) for rid, prompt, p in work]
    _, want, want_depths = serve(family, work, False, **CONFIGS[cfg])
    engine, got, depths = serve(family, work, True, **CONFIGS[cfg])
    assert got == want and depths == want_depths
    stats = engine.stats().prefix_cache
    assert stats.hits > 0 and stats.queries == sum(len(p) for _, p, _ in work)
    if "priority" in cfg or "preempt" in cfg:
        assert engine.counters.preemptions > 0, "the workload must actually preempt"
    if cfg == "preempt-incremental":
        assert stats.evicted_blocks > 0, "the pool must be small enough to evict"


def test_shared_prefix_skips_cached_tokens_on_every_loop(family):
    """One request computes the system prompt; the later ones hit all its full blocks but the
    one of a prompt's last token, and the loops they skip are exactly those blocks' loops."""
    rng = random.Random(5)
    system = [rng.randrange(0, 256) for _ in range(10 * BS)]
    params = SamplingParams(max_tokens=4, ignore_eos=True, min_loops=1, max_loops=3,
                            exit_threshold=1.0, seed=0)
    turns = [[rng.randrange(0, 256) for _ in range(n)] for n in (1, 7, 50, 0)]
    runs = {}
    for caching in (False, True):
        engine = make_engine(family, enable_prefix_caching=caching)
        outs = {}
        for i, user in enumerate(turns):  # one after another: each sees the ones before cached
            engine.add_request(system + user, params, request_id=f"u{i}")
            outs.update(run_to_completion(engine)[0])
        runs[caching] = engine, outs
    (off, want), (on, got) = runs[False], runs[True]
    assert got == want
    hits = on.stats().prefix_cache.hits
    # u1..u2 hit the 10 system blocks, u3 (the system prompt alone) 9: its last token runs
    assert hits == (10 + 10 + 9) * BS
    assert off.counters.loops_run - on.counters.loops_run == hits * 3
    assert off.stats().prefix_cache == PrefixCacheStats(queries=0, hits=0, cached_blocks=0, evicted_blocks=0)


def test_long_shared_prefixes_over_capacity_with_eviction():
    """Real shapes: 1.2k-1.5k-token system prompts with 50-200-token turns, more requests than
    max_num_seqs, and a pool of about two requests: the third system prompt evicts cached
    blocks of the others (those not used lately first) and later turns still hit."""
    rng = random.Random(11)
    systems = [[rng.randrange(0, 256) for _ in range(n)] for n in (1200, 1500, 1300)]
    work = []
    for i, k in enumerate((0, 1, 0, 1, 2, 2, 0, 2)):
        user = [rng.randrange(0, 256) for _ in range(rng.randrange(50, 201))]
        work.append((f"l{i}", systems[k] + user,
                     SamplingParams(max_tokens=3, ignore_eos=True, exit_threshold=0.8, seed=0)))
    cfg = dict(block_size=16, max_model_len=2048, num_blocks=4 * 240, max_num_seqs=2)
    _, want, want_depths = serve("tiny-ouro", work, False, first=2, **cfg)
    engine, got, depths = serve("tiny-ouro", work, True, first=2, **cfg)
    assert got == want and depths == want_depths
    stats = engine.stats().prefix_cache
    # l2, l3 and l7 find their system prompt (l6 finds it evicted: used least lately)
    assert stats.hits >= 3 * 1100 and stats.evicted_blocks > 0


def test_pd_caches_on_both_sides(family):
    """The prefill side skips cached prompt work; the decode side, holding a prefix from an
    earlier handoff, reads only the blocks after it."""
    work = shared_prefix_workload(n=9, seed=3)
    runs = {}
    for caching in (False, True):
        p = make_engine(family, role="prefill", enable_prefix_caching=caching)
        d = make_engine(family, role="decode", enable_prefix_caching=caching)
        tokens: dict[str, list[int]] = {}
        for k in range(0, len(work), 3):  # three waves: later waves find earlier prompts cached
            for rid, prompt, params in work[k:k + 3]:
                p.add_request(prompt, params, request_id=rid)
            tokens.update(run_pd(p, d).tokens)
        runs[caching] = p, d, tokens
    assert runs[True][2] == runs[False][2]
    p, d, _ = runs[True]
    assert p.stats().prefix_cache.hits > 0 and d.stats().prefix_cache.hits > 0


@pytest.mark.parametrize("mode", ["per_loop", "last_loop"])
def test_dory(tmp_path_factory, mode):
    """per_loop caches like the others; last_loop is never cached (Dory.prefix_cache_seeded)."""
    from loopserve.engine.config import EngineConfig
    from loopserve.engine.engine_core import EngineCore
    from tests.model.test_dory import models

    _, m = models(tmp_path_factory, 3, mode)
    work = shared_prefix_workload(n=9, seed=4, max_tokens=6)
    work = [(rid, prompt, replace(p, max_loops=min(p.max_loops, 3)) if p.max_loops else p)
            for rid, prompt, p in work]
    res = {}
    for caching in (False, True):
        e = EngineCore(EngineConfig(model="dory", block_size=BS, num_blocks=1024, max_model_len=128,
                                    enable_prefix_caching=caching), model=m)
        for rid, prompt, params in work[:3]:
            e.add_request(prompt, params, request_id=rid)
        res[caching] = e, run_to_completion(e, arrivals=work[3:])
    assert res[True][1] == res[False][1]
    hits = res[True][0].stats().prefix_cache.hits
    assert (hits > 0) if mode == "per_loop" else (hits == 0)
