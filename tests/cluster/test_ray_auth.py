"""The local Ray cluster the product starts (as `ray_launcher` configures it, whoever imports
ray next): a process without its token cannot join it and reach the workers' actors, and
every socket it, its workers and their NIXL agents listen on is on loopback, none on a port a
user's own Ray head takes by default."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.sockets import LOOPBACK, RAY_DEFAULT_PORTS, listening_sockets

ray = pytest.importorskip("ray")

PROBE = """
import sys, ray
try:
    ray.init(address=sys.argv[1], log_to_driver=False)
except Exception as e:
    print("REFUSED", type(e).__name__); sys.exit(0)
print("JOINED", sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)))
"""


def _probe(env: dict) -> str:
    gcs = ray.get_runtime_context().gcs_address
    env = {**env, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-c", PROBE, gcs], env=env, capture_output=True,
                         text=True, timeout=120)
    return next((line for line in out.stdout.splitlines() if line.startswith(("REFUSED", "JOINED"))),
                 out.stdout + out.stderr[-2000:])


def test_a_process_without_the_cluster_token_cannot_reach_the_workers(pd_workers):
    token = Path(os.environ["RAY_AUTH_TOKEN_PATH"])
    assert os.environ["RAY_AUTH_MODE"] == "token" and token.stat().st_mode & 0o777 == 0o600
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH")}
    assert _probe(clean).startswith("REFUSED")  # Ray's default mode: no token at all
    wrong = token.with_name("wrong_token")
    wrong.write_text("0" * 64)
    assert _probe({**clean, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(wrong)}).startswith("REFUSED")
    # The same probe holding the token joins and sees the workers (so the refusals mean something).
    joined = _probe({**clean, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)})
    assert joined.startswith("JOINED") and pd_workers["decode"][0].worker_id in joined, joined


def test_every_listener_of_the_cluster_is_on_loopback(pd_workers):
    sockets = listening_sockets(os.getpid())
    assert len({pid for pid, *_ in sockets}) >= 4, sockets  # gcs, raylet, the workers...
    exposed = [s for s in sockets if s[2] not in LOOPBACK]
    assert not exposed, exposed
    # The ports a user's own `ray start --head` takes by default stay free for it.
    assert not [s for s in sockets if s[3] in RAY_DEFAULT_PORTS], sockets
