"""Routing policies (issue 39): one class each, found by name in a registry, named by a
config; the router routes by the policy it is given."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import ClassVar

import pytest

from loopserve.cluster.config import ConfigError, load_cluster_config
from loopserve.cluster.placement import stop_all
from loopserve.cluster.router.core import Router
from loopserve.cluster.router.policy import (ROUTING_POLICIES, LeastLoaded, PrefixAware, RoutingPolicy,
                                             decode_load, entry_load, make_policy)
from loopserve.protocol.sampling_params import SamplingParams
from tests.cluster.conftest import ENGINE
from tests.cluster.inprocess import InProcessHandle


@dataclass
class _W:
    id: str
    queue_depth: int
    free_blocks: float
    sent: int = 0


def test_registry_holds_the_shipped_policies():
    assert {"least_loaded", "prefix_aware"} <= set(ROUTING_POLICIES)
    assert ROUTING_POLICIES["prefix_aware"] is PrefixAware and ROUTING_POLICIES["least_loaded"] is LeastLoaded


def test_a_new_policy_is_one_class():
    @dataclass(frozen=True)
    class FirstById(RoutingPolicy):
        name: ClassVar[str] = "test_first_by_id"

        def choose(self, workers, cached, by_load):
            return min(workers, key=lambda w: w.id)

    try:
        policy = make_policy("test_first_by_id")
        assert isinstance(policy, FirstById)
        assert policy.choose([_W("b", 0, 9), _W("a", 5, 1)], {}, entry_load).id == "a"
        assert load_cluster_config({"server": {"routing": {"policy": "test_first_by_id"}}}
                                   ).server.routing.build() == FirstById()
    finally:
        del ROUTING_POLICIES["test_first_by_id"]


def test_prefix_aware_prefers_the_cache_within_its_load_slack():
    ws = [_W("idle", 0, 100), _W("cached", 3, 100), _W("busy-cached", 9, 100)]
    cached = {"cached": 64, "busy-cached": 128}
    assert PrefixAware().choose(ws, cached, entry_load).id == "cached"  # 3 <= 0 + 4; 9 is not
    assert PrefixAware(load_slack=2).choose(ws, cached, entry_load).id == "idle"
    assert PrefixAware(load_slack=9).choose(ws, cached, entry_load).id == "busy-cached"
    assert LeastLoaded().choose(ws, cached, entry_load).id == "idle"
    # decode workers: the most free blocks first
    assert LeastLoaded().choose([_W("a", 0, 10), _W("b", 5, 50)], {}, decode_load).id == "b"


def test_config_names_a_policy_and_its_parameters():
    server = load_cluster_config({"server": {"routing": {"policy": "prefix_aware",
                                                         "params": {"load_slack": 7}}}}).server
    assert server.routing.build() == PrefixAware(load_slack=7)
    assert load_cluster_config({}).server.routing.build() == PrefixAware()


@pytest.mark.parametrize("routing, needle", [
    ({"policy": "round_robin"}, "unknown routing policy 'round_robin'"),
    ({"policy": "least_loaded", "params": {"load_slack": 1}}, "has no parameter(s) ['load_slack']"),
    ({"policy": "prefix_aware", "params": {"load_slack": -1}}, "load_slack must be an integer >= 0"),
])
def test_bad_routing_config_names_the_problem(routing, needle):
    with pytest.raises(ConfigError) as e:
        load_cluster_config({"server": {"routing": routing}})
    assert "server.routing" in str(e.value) and needle in str(e.value)


def test_least_loaded_router_ignores_prefixes():
    """Two workers, one system prompt: by load alone the turns alternate, and the router keeps
    no prefix index (it never learns the workers' keyers)."""
    rng = random.Random(3)
    system = [rng.randrange(0, 256) for _ in range(192)]
    handles = [InProcessHandle(f"ll-{i}", ENGINE) for i in range(2)]
    router = Router(handles, poll_s=0.1, policy=LeastLoaded()).start()
    params = SamplingParams(max_tokens=4, ignore_eos=True, seed=0)

    async def one_by_one():
        for i in range(6):
            async for _ in router.generate(system + [rng.randrange(0, 256) for _ in range(5)], params, f"q{i}"):
                pass

    try:
        asyncio.run(one_by_one())
        assert not router.prefix_routing and all(w.keyer is None for w in router._entry)
        assert sorted(h.stats().accepted for h in handles) == [3, 3]
        assert router.metrics.routed_cached_tokens._value.get() == 0
    finally:
        router.close()
        stop_all(handles)
