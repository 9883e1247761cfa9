"""Security of the real gRPC server: loopback by default, a bearer token on EVERY RPC, TLS and
mTLS with certificates made in the test."""

from __future__ import annotations

import socket

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loopserve.cluster.config import AUTH_TOKEN_ENV, ServerConfig
from loopserve.entrypoints.grpc.client import LoopServeClient
from loopserve.protocol.sampling_params import SamplingParams
from tests.cluster.certs import self_signed
from tests.cluster.conftest import serving

TOKEN = "s3cret-token"
# Every kind of RPC the server has: LoopServe's four, grpc.health.v1's unary Check and
# streaming Watch, and a method nobody registered.
RPCS = {
    "Generate": lambda c: list(c.generate("hi", SamplingParams(max_tokens=2))),
    "Abort": lambda c: c.abort("nobody"),
    "Health": lambda c: c.health(),
    "GetStats": lambda c: c.stats(),
    "health.Check": lambda c: c.health_check(),
    "health.Watch": lambda c: next(health_pb2_grpc.HealthStub(c.channel).Watch(
        health_pb2.HealthCheckRequest())),
    "unknown method": lambda c: c.channel.unary_unary("/loopserve.v1.LoopServe/Nope")(b""),
}


def _port(client: LoopServeClient) -> int:
    return int(client.address.rsplit(":", 1)[1])


def _accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=5).close()
        return True
    except ConnectionRefusedError:
        return False


@pytest.mark.parametrize("host, on_other_address", [(None, False), ("0.0.0.0", True)])
def test_binds_loopback_only_by_default(colocated_router, host, on_other_address):
    """127.0.0.2 is loopback too, but not the address a 127.0.0.1 server is bound to; the
    0.0.0.0 server shows this check can tell the difference."""
    assert ServerConfig().host == "127.0.0.1"
    with serving(colocated_router, **({"host": host} if host else {})) as client:
        port = _port(client)
        assert _accepts("127.0.0.1", port)
        assert _accepts("127.0.0.2", port) is on_other_address


@pytest.fixture(scope="module")
def with_token(colocated_router):
    with serving(colocated_router, auth_token=TOKEN) as client:
        yield client


@pytest.mark.parametrize("rpc", list(RPCS))
@pytest.mark.parametrize("token", [None, "wrong", TOKEN + "x", TOKEN[:-1], f"Bearer {TOKEN}"])
def test_every_rpc_without_the_right_token_is_unauthenticated(with_token, rpc, token):
    with LoopServeClient(with_token.address, token=token) as client, pytest.raises(grpc.RpcError) as e:
        RPCS[rpc](client)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, e.value.details()
    assert "bearer token" in e.value.details()


@pytest.mark.parametrize("rpc", list(RPCS))
def test_every_rpc_with_the_token_is_served(with_token, rpc):
    with LoopServeClient(with_token.address, token=TOKEN) as client:
        if rpc == "unknown method":
            with pytest.raises(grpc.RpcError) as e:
                RPCS[rpc](client)
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED  # authenticated: past the check
        else:
            assert RPCS[rpc](client) is not None


def test_the_token_comes_from_the_environment_and_is_never_printed(monkeypatch):
    monkeypatch.setenv(AUTH_TOKEN_ENV, TOKEN)
    cfg = ServerConfig()
    assert cfg.auth_token.get_secret_value() == TOKEN
    assert TOKEN not in repr(cfg) and TOKEN not in cfg.model_dump_json()
    with pytest.raises(ValueError, match="auth_token must not be empty"):
        ServerConfig(auth_token="")


def _refused(address: str, **options) -> grpc.StatusCode:
    with LoopServeClient(address, **options) as other, pytest.raises(grpc.RpcError) as e:
        other.health_check()
    return e.value.code()


def test_tls_client_is_served_and_plaintext_or_untrusting_clients_are_not(colocated_router, tmp_path):
    cert, key = self_signed(tmp_path, "server")
    trusting = {"root_certificates": cert.read_bytes(), "token": TOKEN}
    with serving(colocated_router, client_options=trusting, tls_cert_file=cert,
                          tls_key_file=key, auth_token=TOKEN) as client:
        assert client.health_check() == "SERVING"
        assert list(client.generate("over TLS", SamplingParams(max_tokens=2)))[-1].kind == "complete"
        assert _refused(client.address, token=TOKEN) == grpc.StatusCode.UNAVAILABLE  # plaintext
        # TLS trusting only the system's roots: the self-signed certificate is not among them
        assert _refused(client.address, token=TOKEN, tls=True) == grpc.StatusCode.UNAVAILABLE


def test_mtls_serves_only_clients_with_a_certificate_it_trusts(colocated_router, tmp_path):
    cert, key = self_signed(tmp_path, "server")
    client_cert, client_key = self_signed(tmp_path, "client")
    stranger_cert, stranger_key = self_signed(tmp_path, "stranger")
    root = cert.read_bytes()
    mine = {"root_certificates": root, "private_key": client_key.read_bytes(),
            "certificate_chain": client_cert.read_bytes()}
    with serving(colocated_router, client_options=mine, tls_cert_file=cert, tls_key_file=key,
                          tls_client_ca_file=client_cert) as client:
        assert client.health_check() == "SERVING"
        assert _refused(client.address, root_certificates=root) == grpc.StatusCode.UNAVAILABLE
        assert _refused(client.address, root_certificates=root, private_key=stranger_key.read_bytes(),
                        certificate_chain=stranger_cert.read_bytes()) == grpc.StatusCode.UNAVAILABLE
