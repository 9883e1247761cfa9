"""Prefix-aware routing (issue 29): the router's index of prefixes sent to each entry worker,
and two in-process colocated workers each serving one system prompt's requests."""

import asyncio
import random

from loopserve.cluster.placement import stop_all
from loopserve.cluster.prefix_index import CHUNK, PrefixIndex, prefix_keys
from loopserve.cluster.router import Router
from loopserve.engine.sampling_params import SamplingParams
from tests.cluster.conftest import ENGINE
from tests.cluster.inprocess import InProcessHandle


def test_index_matches_the_longest_prefix_sent_to_each_worker():
    a = list(range(3 * CHUNK))
    idx = PrefixIndex()
    idx.record("w0", prefix_keys(a))
    idx.record("w1", prefix_keys(a[:CHUNK] + [7] * (2 * CHUNK)))
    assert idx.match(prefix_keys(a + [1, 2])) == {"w0": 3, "w1": 1}
    assert idx.match(prefix_keys([9] * CHUNK)) == {}
    assert prefix_keys("x" * (CHUNK - 1)) == [] and len(prefix_keys("x" * CHUNK)) == 1
    assert prefix_keys([1, "bad"] * CHUNK) == []  # the worker refuses it; routing does not raise
    idx.forget("w0")
    assert idx.match(prefix_keys(a)) == {"w1": 1}
    small = PrefixIndex(capacity=2)
    small.record("w", prefix_keys(a))
    assert small.match(prefix_keys(a)) == {}  # the oldest key (the first chunk) went


def test_requests_sharing_a_system_prompt_go_where_it_is_cached():
    rng = random.Random(3)
    systems = [[rng.randrange(0, 256) for _ in range(3 * CHUNK)] for _ in range(2)]
    handles = [InProcessHandle(f"prefix-{i}", ENGINE) for i in range(2)]
    router = Router(handles, poll_s=0.1).start()
    params = SamplingParams(max_tokens=2, ignore_eos=True, seed=0)  # one seed: Huginn shares

    async def one_by_one():
        for i in range(8):
            prompt = systems[i % 2] + [rng.randrange(0, 256) for _ in range(5)]
            [o async for o in router.generate(prompt, params, f"u{i}")]

    try:
        asyncio.run(one_by_one())
        stats = [h.stats() for h in handles]
        # each worker served one system prompt: 3 later turns of it hit all its 48 blocks
        assert [s["accepted"] for s in stats] == [4, 4]
        assert [s["prefix_cache"]["hits"] for s in stats] == [3 * 3 * CHUNK] * 2
    finally:
        router.close()
        stop_all(handles)
