"""Routing policies: which of the healthy workers of one role gets a request (or its handoff).

A policy is one class: subclass `RoutingPolicy` with a `name` and `choose`; it registers
itself in `ROUTING_POLICIES`, and `server.routing.policy` (with `server.routing.params` for
its fields) names it in a config. `choose` gets the candidates (never empty), the prompt
tokens each one's prefix cache holds (`uses_prefixes` policies only; empty otherwise) and the
role's load order (`ENTRY_LOAD` or `DECODE_LOAD`: smaller is better).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Protocol


class WorkerView(Protocol):
    """What a policy may read of a worker (`workers.WorkerState`)."""

    id: str
    sent: int

    @property
    def queue_depth(self) -> int: ...

    @property
    def free_blocks(self) -> float: ...


LoadOrder = Callable[[WorkerView], tuple]


def entry_load(w: WorkerView) -> tuple:
    """Entry (prefill, colocated) workers: the shortest queue first, then the most free KV."""
    return (w.queue_depth, -w.free_blocks, w.sent)


def decode_load(w: WorkerView) -> tuple:
    """Decode workers: the most free KV first (a handoff reserves its whole reply's blocks)."""
    return (-w.free_blocks, w.queue_depth, w.sent)


ROUTING_POLICIES: dict[str, type[RoutingPolicy]] = {}


class RoutingPolicy(ABC):
    name: ClassVar[str]
    uses_prefixes: ClassVar[bool] = False  # the router keeps the prefix index and keys prompts

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if cls.name in ROUTING_POLICIES:
            raise ValueError(f"routing policy {cls.name!r} is defined twice")
        ROUTING_POLICIES[cls.name] = cls

    @abstractmethod
    def choose(self, workers: list[WorkerView], cached: Mapping[str, int],
               by_load: LoadOrder) -> WorkerView:
        """The worker to send to (`workers` is not empty)."""


@dataclass(frozen=True)
class LeastLoaded(RoutingPolicy):
    """By load alone."""

    name: ClassVar[str] = "least_loaded"

    def choose(self, workers: list[WorkerView], cached: Mapping[str, int],
               by_load: LoadOrder) -> WorkerView:
        return min(workers, key=by_load)


@dataclass(frozen=True)
class PrefixAware(RoutingPolicy):
    """The worker holding the most of the prompt among those within `load_slack` queued +
    running requests of the least loaded, else by load: a cached prefix skips its prefill,
    a longer queue delays it."""

    name: ClassVar[str] = "prefix_aware"
    uses_prefixes: ClassVar[bool] = True
    load_slack: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.load_slack, int) or self.load_slack < 0:
            raise ValueError(f"load_slack must be an integer >= 0, got {self.load_slack!r}")

    def choose(self, workers: list[WorkerView], cached: Mapping[str, int],
               by_load: LoadOrder) -> WorkerView:
        least = min(w.queue_depth for w in workers)
        near = [w for w in workers if cached.get(w.id) and w.queue_depth <= least + self.load_slack]
        if near:
            return max(near, key=lambda w: (cached[w.id], -w.queue_depth, w.free_blocks, -w.sent))
        return min(workers, key=by_load)


def make_policy(name: str, params: Mapping[str, Any] | None = None) -> RoutingPolicy:
    """The named policy with `params` as its fields; ValueError names what is wrong."""
    if name not in ROUTING_POLICIES:
        raise ValueError(f"unknown routing policy {name!r}; known: {sorted(ROUTING_POLICIES)}")
    cls = ROUTING_POLICIES[name]
    known = {f.name for f in fields(cls)} if hasattr(cls, "__dataclass_fields__") else set()
    if unknown := sorted(set(params or {}) - known):
        raise ValueError(f"routing policy {name!r} has no parameter(s) {unknown}; "
                         f"it takes {sorted(known) or 'none'}")
    return cls(**(params or {}))
