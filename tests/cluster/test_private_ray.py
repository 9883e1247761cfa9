"""Issue 38 finding 1: a server without `ray.address` starts a private Ray cluster whatever
else runs on the machine, joins only an explicit address (with a deadline and an error naming
it), never takes the ports a user's own head wants, never shares a gRPC port silently, and
leaves no token directory behind.

The foreign head is a real `ray start --head --block` with its own token, under its own
RAY_TMPDIR (so it writes the `ray/ray_current_cluster` file a bare `ray.init()` follows
without touching other users' /tmp/ray), stopped by its PID (never `ray stop`).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from loopserve.cluster.config import ServerConfig
from loopserve.entrypoints.grpc.server import Server
from tests.cluster.conftest import running

pytest.importorskip("ray")
REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))

# Starts the product's cluster the way `loopserve serve` does (no address), reports where it
# went, and exits without stopping it: the exit must take the head and the token dir down.
SERVER = """
import json, os
from loopserve.cluster import ray_launcher  # first: it sets Ray's token mode before ray loads
import ray
from loopserve.cluster.config import RayConfig
from tests.cluster.sockets import listening_sockets
head = ray_launcher.ensure_ray(RayConfig(num_cpus=1))
print("RESULT", json.dumps({"gcs": ray.get_runtime_context().gcs_address,
      "token": os.environ["RAY_AUTH_TOKEN_PATH"], "head_pid": head.process.pid,
      "ports": sorted({s[3] for s in listening_sockets(os.getpid())})}), flush=True)
"""

JOIN = """
import sys
from loopserve.cluster import ray_launcher
from loopserve.cluster.config import RayConfig
try:
    ray_launcher.ensure_ray(RayConfig(address=sys.argv[1]))
except ConnectionError as e:
    print("REFUSED", e)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS"))}
    return {**env, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(REPO), **extra}


@pytest.fixture
def foreign_head():
    """Another user's head: its own token, on RAY_TMPDIR's ray/ (its address file is where a
    bare ray.init() with that RAY_TMPDIR looks). Yields (env of that machine, its GCS address)."""
    root = Path(tempfile.mkdtemp(prefix="lsf", dir="/tmp"))  # short: Ray's socket paths
    token = root / "token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    machine = {"RAY_TMPDIR": str(root)}
    gcs = _free_port()
    env = _env(**machine, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(token))
    log = open(root / "head.log", "wb")
    head = subprocess.Popen([RAY, "start", "--head", "--block", f"--port={gcs}", "--num-cpus=1",
                             "--node-ip-address=127.0.0.1", "--include-dashboard=false",
                             f"--dashboard-agent-listen-port={_free_port()}",
                             f"--ray-client-server-port={_free_port()}"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        while not (root / "ray" / "ray_current_cluster").exists():
            assert head.poll() is None, (root / "head.log").read_text()[-2000:]
            time.sleep(0.2)
        yield machine, f"127.0.0.1:{gcs}"
    finally:
        head.terminate()  # by PID: `ray stop` would stop every Ray of the machine
        head.wait(60)
        log.close()


def test_a_server_without_an_address_starts_a_private_cluster_beside_a_foreign_head(foreign_head):
    machine, foreign = foreign_head
    out = subprocess.run([sys.executable, "-c", SERVER], env=_env(**machine), cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULT ")), None)
    assert out.returncode == 0 and line, out.stdout[-2000:] + out.stderr[-4000:]
    got = json.loads(line[len("RESULT "):])
    assert got["gcs"] != foreign, got  # its own cluster, not the head the address file names
    assert not set(got["ports"]) & {6379, 8265, 52365, 10001}, got["ports"]
    token = Path(got["token"])
    assert token.name == "auth_token" and token.parent.name.startswith("loopserve-ray-")
    assert not token.parent.exists(), "the token directory outlived the server"
    assert not Path(f"/proc/{got['head_pid']}").exists() or \
        Path(f"/proc/{got['head_pid']}/stat").read_text().split()[2] == "Z", "the head outlived the server"


def test_joining_an_address_where_nothing_answers_fails_naming_it():
    address = f"127.0.0.1:{_free_port()}"  # bound a moment ago, nothing listens now
    out = subprocess.run([sys.executable, "-c", JOIN, address], env=_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert f"REFUSED no Ray cluster answers at {address}" in out.stdout, out.stdout + out.stderr[-3000:]


def test_a_second_grpc_server_on_a_bound_port_fails_loudly(colocated_router):
    with running(Server(colocated_router, ServerConfig(port=0))) as first:
        second = Server(colocated_router, ServerConfig(port=first.port))
        with pytest.raises(OSError, match=f"127.0.0.1:{first.port}"):
            asyncio.run(second.start())
