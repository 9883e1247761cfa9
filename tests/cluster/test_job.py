"""`ray job submit --working-dir . -- python -m loopserve.job ...` on a head this test
starts (its own ports and temp dir) and stops (SIGTERM to `ray start --block`, which takes its
processes down with it; `ray stop` would kill every Ray on the machine)."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def ray_head():
    gcs, dash, agent = _free_ports(3)
    temp = tempfile.mkdtemp(prefix="lsj", dir="/tmp")
    token = Path(tempfile.mkdtemp(prefix="lsjt", dir="/tmp")) / "token"
    token.write_text(secrets.token_hex(16))
    token.chmod(0o600)
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token",
           "RAY_AUTH_TOKEN_PATH": str(token), "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    env.pop("RAY_AUTH_TOKEN", None)
    log = open(Path(temp) / "head.log", "w")
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", f"--port={gcs}", f"--dashboard-port={dash}",
         f"--dashboard-agent-listen-port={agent}", "--dashboard-host=127.0.0.1",
         "--include-dashboard=true", "--num-cpus=3", f"--temp-dir={temp}", "--disable-usage-stats"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{dash}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(  # the dashboard wants the token too
                    f"{url}/api/version", headers={"Authorization": f"Bearer {token.read_text()}"}),
                    timeout=2)
                break
            except OSError:
                assert head.poll() is None, (Path(temp) / "head.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "ray head did not come up"
                time.sleep(0.5)
        yield url, env
    finally:
        head.terminate()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        log.close()


def test_ray_job_submit_runs_workload_and_exits(ray_head):
    url, env = ray_head
    r = subprocess.run(
        [RAY, "job", "submit", "--address", url, "--working-dir", ".", "--",
         "python", "-m", "loopserve.job", "--config", "configs/cpu-1p1d.yaml",
         "--workload", "4", "--max-tokens", "6"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("{"))
    summary = json.loads(line)
    assert summary["ok"] == 4 and summary["output_tokens"] == 24 and summary["mode"] == "pd"
    assert summary["workers"] == ["prefill-0", "decode-0"]
    assert all(u["looped"]["used"] == 0 for u in summary["kv_after"].values())
    assert "succeeded" in r.stdout + r.stderr
