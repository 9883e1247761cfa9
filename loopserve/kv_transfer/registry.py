"""KV connectors by the name `transfer.connector` gives (a new transport: one entry here).

Entries are import paths, loaded on first use: validating a config that names a connector
loads neither torch nor the transport's library.
"""

from __future__ import annotations

import importlib
from typing import Annotated

from pydantic import AfterValidator

from loopserve.kv_transfer.connector import KVConnector

CONNECTORS: dict[str, str] = {
    "nixl": "loopserve.kv_transfer.nixl_agent:NixlKVWorker",
}
DEFAULT_CONNECTOR = "nixl"


def check_connector_name(name: str) -> str:
    if name not in CONNECTORS:
        raise ValueError(f"unknown KV connector {name!r}; known: {sorted(CONNECTORS)}")
    return name


KVConnectorName = Annotated[str, AfterValidator(check_connector_name)]


def connector_class(name: str) -> type[KVConnector]:
    """The class registered as `name`; ValueError naming transfer.connector if there is none."""
    try:
        check_connector_name(name)
    except ValueError as e:
        raise ValueError(f"transfer.connector: {e}") from None
    module, cls = CONNECTORS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def make_connector(name: str, engine_id: str, pools: dict, block_size: int, compat: dict,
                   progress_thread: bool) -> KVConnector:
    """A connector of kind `name` over one engine's KV pools (see KVConnector)."""
    return connector_class(name)(engine_id, pools, block_size, compat, progress_thread=progress_thread)
