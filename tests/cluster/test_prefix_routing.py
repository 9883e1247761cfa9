"""Prefix-aware routing and per-request disaggregation (issue 29): the router's index of the
workers' prefix caches, fed by their KV events; the router's block keys equal the engine's;
requests go where their prefix is cached (entry and decode workers); a short uncached prompt
is prefilled on its decode worker with the same tokens as colocated serving."""

import asyncio
import random

import pytest

from loopserve.cluster.placement import stop_all
from loopserve.cluster.router.core import Router, _Prompt
from loopserve.cluster.router.prefix_index import PrefixIndex
from loopserve.engine.config import EngineConfig
from loopserve.engine.engine_core import EngineCore
from loopserve.kv_cache import CacheEvents
from loopserve.protocol.sampling_params import SamplingParams
from loopserve.worker_host import host as host_module
from tests.cluster.conftest import ENGINE
from tests.cluster.inprocess import InProcessHandle

TRANSFER = {"lease_s": 20, "heartbeat_s": 0.5, "read_timeout_s": 20}
GREEDY = SamplingParams(max_tokens=4, ignore_eos=True, seed=0)  # one seed: Huginn's keys share it


def test_index_follows_the_workers_cache_events():
    a, b, c = b"a", b"b", b"c"
    idx = PrefixIndex()
    idx.apply("w0", CacheEvents([(True, a), (True, b)], reset=True))
    idx.apply("w1", CacheEvents([(True, a), (True, c)]))
    assert idx.match([a, b, c], ["w0", "w1", "w2"]) == {"w0": 2, "w1": 1, "w2": 0}
    idx.apply("w0", CacheEvents([(False, a), (False, c)]))  # c was never w0's: ignored
    assert idx.match([a, b], ["w0", "w1"]) == {"w0": 0, "w1": 1}
    idx.apply("w1", CacheEvents([(True, b)], reset=True))  # a snapshot replaces what was known
    assert idx.match([a], ["w1"]) == {"w1": 0} and idx.num_blocks("w1") == 1
    idx.forget("w0")
    assert idx.num_blocks("w0") == 0 and idx.match([b], ["w0", "w1"]) == {"w0": 0, "w1": 1}


@pytest.mark.parametrize("seed", [7, None])
def test_router_keys_equal_the_engines(seed):
    engine = EngineCore(EngineConfig(**ENGINE))
    try:
        params = SamplingParams(max_tokens=2, seed=seed, max_loops=3)
        text = "the same system prompt, then a question " * 3
        rid = engine.add_request(text, params)
        mine = engine.scheduler.get_request(rid).request.block_hashes
        ids = engine.tokenizer.encode(text)
        routed = _Prompt(ids, engine.limits.check(ids, params)).keys(engine.prefix_keyer)
        if engine.prefix_keyer.seeded and seed is None:  # the engine draws the seed: unknown here
            assert routed == () and mine
        else:
            assert routed == mine and len(mine) == len(engine.tokenizer.encode(text)) // ENGINE["block_size"]
    finally:
        engine.shutdown()


def _run(router, prompts, params=GREEDY):
    async def one_by_one():
        out = []
        for i, prompt in enumerate(prompts):
            toks = [t for o in [o async for o in router.generate(prompt, params, f"q{i}")]
                    for t in o.new_token_ids]
            out.append(toks)
        return out
    return asyncio.run(one_by_one())


def test_requests_sharing_a_system_prompt_go_where_it_is_cached():
    rng = random.Random(3)
    systems = [[rng.randrange(0, 256) for _ in range(192)] for _ in range(2)]
    handles = [InProcessHandle(f"prefix-{i}", ENGINE) for i in range(2)]
    router = Router(handles, poll_s=0.1).start()
    try:
        _run(router, [systems[i % 2] + [rng.randrange(0, 256) for _ in range(5)] for i in range(8)])
        stats = [h.stats() for h in handles]
        # each worker served one system prompt: its 3 later turns hit all 48 of its blocks
        assert [s.accepted for s in stats] == [4, 4]
        assert [s.engine.prefix_cache.hits for s in stats] == [3 * 192] * 2
        assert router.metrics.routed_cached_tokens._value.get() == 6 * 192
    finally:
        router.close()
        stop_all(handles)


def test_events_past_the_buffer_fold_into_a_snapshot(monkeypatch):
    monkeypatch.setattr(host_module, "MAX_CACHE_CHANGES", 3)
    handle = InProcessHandle("fold", ENGINE)
    router = Router([handle], poll_s=0.1).start()
    try:
        rng = random.Random(5)
        prompts = [[rng.randrange(0, 256) for _ in range(41)] for _ in range(4)]
        _run(router, prompts)  # 10 blocks stored per request: each poll's changes overflow
        engine = handle.host.engine
        assert router._prefixes.num_blocks("fold") == len(engine.kv_manager.prefix) == 40
        keyer = engine.prefix_keyer
        assert router._cached_tokens(router._check(prompts[-1], GREEDY), router._entry) == {"fold": 40}
        assert keyer.block_size == ENGINE["block_size"]
    finally:
        router.close()
        stop_all([handle])


@pytest.fixture
def pd_1p2d():
    p = InProcessHandle("lp-p", ENGINE, "prefill", TRANSFER)
    ds = [InProcessHandle(f"lp-d{i}", ENGINE, "decode", TRANSFER) for i in range(2)]
    ref = InProcessHandle("lp-ref", ENGINE)
    yield p, ds, ref
    stop_all([p, *ds, ref])


def test_short_uncached_prompts_prefill_on_their_decode_worker(pd_1p2d):
    """Below local_prefill_tokens (uncached, on the decode worker chosen) a prompt never visits
    the prefill worker; a long one does; a long one whose prefix the decode worker holds
    (from an earlier handoff) is short uncached, so it stays there too. Tokens as colocated."""
    p, ds, ref = pd_1p2d
    rng = random.Random(11)
    system = [rng.randrange(0, 256) for _ in range(96)]
    prompts = [[rng.randrange(0, 256) for _ in range(10)],  # short: local
               system + [1, 2, 3, 4],  # long, nothing cached: remote
               system + [9, 8, 7, 6, 5, 4]]  # 96 of 102 tokens cached where it decodes: local
    router = Router([p], ds, poll_s=0.1, local_prefill_tokens=32).start()
    try:
        got = _run(router, prompts)
        routed = router.metrics.routed
        assert (routed.labels("local")._value.get(), routed.labels("remote")._value.get()) == (2, 1)
        assert p.stats().accepted == 1
        assert sum(d.stats().accepted for d in ds) == 3  # 2 local + 1 handoff
    finally:
        router.close()
    ref_router = Router([ref], poll_s=0.1).start()
    try:
        assert got == _run(ref_router, prompts) and all(len(t) == 4 for t in got)
    finally:
        ref_router.close()


def test_a_handoff_goes_to_the_decode_worker_holding_its_prefix(pd_1p2d):
    """Without prefix routing the second handoff would go to the decode worker sent fewer
    requests; it goes to the one whose cache holds the prompt's 24 leading blocks, and READs
    only the blocks after them."""
    p, ds, _ = pd_1p2d
    rng = random.Random(13)
    system = [rng.randrange(0, 256) for _ in range(96)]
    router = Router([p], ds, poll_s=0.1).start()
    try:
        _run(router, [system + [1, 2, 3], system + [4, 5, 6, 7]])
        accepted = sorted(d.stats().accepted for d in ds)
        assert accepted == [0, 2]
        holder = max(ds, key=lambda d: d.stats().accepted)
        assert holder.stats().engine.prefix_cache.hits == 96
    finally:
        router.close()
