"""The KV connector seam: NIXL and the tests' delayed-READ transport implement the whole
interface with its signatures, workers build the connector `transfer.connector` names, and
a name no registry entry has is refused naming the field."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
from pydantic import ValidationError

from loopserve.cluster.config import TransferConfig
from loopserve.decode_worker.worker import DecodeWorker
from loopserve.kv_transfer.connector import HANDSHAKE_KEYS, KVCompatError, KVConnector, check_compat
from loopserve.kv_transfer.nixl_agent import NixlKVWorker
from loopserve.kv_transfer.registry import CONNECTORS, connector_class
from loopserve.prefill_worker.worker import PrefillWorker
from tests.cluster.faulty import DelayedReads

ENGINE = {"model": "tiny-huginn", "block_size": 4, "num_blocks": 64, "max_model_len": 64}


@pytest.mark.parametrize("cls", [NixlKVWorker, DelayedReads])
def test_transports_implement_the_whole_interface(cls):
    assert issubclass(cls, KVConnector) and not cls.__abstractmethods__
    for name in KVConnector.__abstractmethods__:
        ours, theirs = inspect.signature(getattr(cls, name)), inspect.signature(getattr(KVConnector, name))
        assert list(ours.parameters.items()) == list(theirs.parameters.items()), f"{cls.__name__}.{name}"


def test_every_registered_connector_is_one():
    for name in CONNECTORS:
        assert issubclass(connector_class(name), KVConnector)
    assert connector_class("nixl") is NixlKVWorker


def test_an_unknown_connector_is_refused_naming_the_field():
    with pytest.raises(ValidationError, match=r"connector\n.*unknown KV connector 'tcp'; known: \['nixl'\]"):
        TransferConfig(connector="tcp")
    with pytest.raises(ValueError, match=r"transfer\.connector: unknown KV connector 'tcp'"):
        connector_class("tcp")
    with pytest.raises(ValueError, match=r"transfer\.connector: unknown KV connector 'tcp'"):
        DecodeWorker("d-bad", ENGINE, {"connector": "tcp"})


def test_naming_a_connector_loads_no_torch():
    code = ("import sys; from loopserve.kv_transfer.registry import KVConnectorName, CONNECTORS; "
            "assert 'torch' not in sys.modules, 'torch loaded'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_compat_check_names_every_difference():
    check_compat("a", {"model": "m", "block_size": 4}, "b", {"model": "m", "block_size": 4})
    with pytest.raises(KVCompatError, match="block_size is 8 on 'b' but 4 on 'a'; model is None on 'b'"):
        check_compat("a", {"model": "m", "block_size": 4}, "b", {"block_size": 8})


def test_workers_take_the_configured_connector_and_shake_hands():
    p = PrefillWorker("p-conn", ENGINE, {"connector": "nixl"})
    d = DecodeWorker("d-conn", ENGINE, {})  # the default
    try:
        assert isinstance(p.connector, NixlKVWorker) and isinstance(d.connector, NixlKVWorker)
        info = p.handshake_info()
        assert HANDSHAKE_KEYS <= info.keys() and info["engine_id"] == "p-conn"
        d.add_peer(info)
        assert d.connector.peers == ["p-conn"]
    finally:
        p.shutdown()
        d.shutdown()
