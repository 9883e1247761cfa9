"""Workers as Ray actors: one actor per worker with its num_cpus / num_gpus.

Actors are threaded (`max_concurrency`) so a pump's long poll does not block submits and
aborts; the worker's own lock serialises the engine.
Without an address (`ray.address`, or RAY_ADDRESS as `ray job submit` sets it) the server
starts a private cluster whatever else runs on the machine: `ray start --head --block` in a
private directory (never /tmp/ray, whose `ray_current_cluster` a bare `ray.init()` would
follow to someone else's head) on free loopback ports (not 6379, 8265, 52365 or 10001, which a
user's own head wants), stopped by signalling that one process. It requires a token (Ray's
token authentication): a fresh random one per cluster in a 0600 file of the same 0700
directory, so no other local process can join it and call the workers' actors; the directory
goes when the process exits. Ray reads the token settings at import, so they are set before
`import ray`. A cluster joined through an address brings its own settings; joining has a
deadline and names the address when nothing answers there.
"""

from __future__ import annotations

import atexit
import ctypes
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

HEAD_START_S = 120.0  # `ray start` on a busy 2-core machine takes ~7 s
CONNECT_S = 10.0  # a TCP answer from an explicit address's GCS
STOP_S = 30.0


def require_token() -> Path:
    """Make the next local cluster require a new random token; returns the token file (mode
    0600, in a 0700 directory removed at exit; the token is never logged). Ray reads these
    variables when it is imported: this runs before that."""
    directory = Path(tempfile.mkdtemp(prefix="loopserve-ray-"))
    atexit.register(shutil.rmtree, directory, ignore_errors=True)
    path = directory / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.environ.pop("RAY_AUTH_TOKEN", None)  # it would take precedence over the file
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    return path


os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
_TOKEN = None
if "RAY_AUTH_MODE" not in os.environ and not os.environ.get("RAY_ADDRESS"):
    _TOKEN = require_token()  # a caller that set RAY_AUTH_MODE (or joins RAY_ADDRESS) brings its own

import ray  # noqa: E402
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError  # noqa: E402

from loopserve.cluster.config import RayConfig  # noqa: E402
from loopserve.cluster.handle import WorkerHandle  # noqa: E402
from loopserve.cluster.worker_spec import WorkerSpec, worker_class  # noqa: E402


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the server dies, however it dies (Linux)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class PrivateHead:
    """A Ray head of this process alone; `stop()` ends it and every process it started."""

    process: subprocess.Popen
    address: str
    directory: Path

    @classmethod
    def start(cls, num_cpus: int | None, num_gpus: int | None,
              timeout: float = HEAD_START_S) -> PrivateHead:
        directory = _TOKEN.parent if _TOKEN is not None else Path(tempfile.mkdtemp(prefix="loopserve-ray-"))
        gcs, dashboard, agent, client = _free_ports(4)
        cmd = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
               f"--temp-dir={directory}", "--node-ip-address=127.0.0.1", f"--port={gcs}",
               "--include-dashboard=false", f"--dashboard-port={dashboard}",
               f"--dashboard-agent-listen-port={agent}", f"--ray-client-server-port={client}"]
        cmd += [f"--num-cpus={num_cpus}"] if num_cpus is not None else []
        cmd += [f"--num-gpus={num_gpus}"] if num_gpus is not None else []
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        logfile = directory / "head.log"
        with open(logfile, "wb") as out:
            proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        head = cls(proc, f"127.0.0.1:{gcs}", directory)
        atexit.register(head.stop)
        ready = directory / "ray_current_cluster"  # written once the head is up
        end = time.monotonic() + timeout
        while not ready.exists():
            if proc.poll() is not None or time.monotonic() > end:
                tail = logfile.read_text(errors="replace")[-2000:]
                head.stop()
                why = f"exited with {proc.returncode}" if proc.returncode is not None else f"not up within {timeout} s"
                raise RuntimeError(f"the private Ray head ({' '.join(cmd[3:])}) {why}:\n{tail}")
            time.sleep(0.1)
        return head

    def stop(self) -> None:
        """Disconnect this process, then SIGTERM to `ray start --block`, which takes its
        processes down with it (never `ray stop`: it stops every Ray instance of the machine)."""
        if ray.is_initialized():
            ray.shutdown()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(STOP_S)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if _TOKEN is None or self.directory != _TOKEN.parent:
            shutil.rmtree(self.directory, ignore_errors=True)


def _check_reachable(address: str, timeout: float = CONNECT_S) -> None:
    """Fail within `timeout` naming `address` when nothing listens there (Ray itself retries
    a dead GCS for minutes)."""
    host, sep, port = address.rpartition(":")
    if "://" in address or not sep or not port.isdigit():
        return  # ray://, auto, ...: Ray's own forms, checked by Ray
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise ConnectionError(f"no Ray cluster answers at {address} (ray.address or RAY_ADDRESS) "
                              f"within {timeout:g} s: {e}") from None


def ensure_ray(cfg: RayConfig) -> PrivateHead | None:
    """Join the configured cluster (ray.address, else RAY_ADDRESS), or else start a private
    one; returns the private head (the caller stops it) or None."""
    if ray.is_initialized():
        return None
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        _check_reachable(address)
        ray.init(address=address, log_to_driver=False)
        return None
    if os.environ.get("RAY_AUTH_MODE") != "token":
        log.warning("starting a Ray cluster without token authentication (RAY_AUTH_MODE=%s): "
                    "any local process can call its workers", os.environ.get("RAY_AUTH_MODE"))
    head = PrivateHead.start(cfg.num_cpus, cfg.num_gpus)
    try:
        ray.init(address=head.address, log_to_driver=False)
    except BaseException:
        head.stop()
        raise
    return head


def ray_nodes() -> list[dict[str, float]]:
    """Resources of every alive node of the connected cluster."""
    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]


class RayWorkerHandle(WorkerHandle):
    def __init__(self, spec: WorkerSpec, max_restarts: int = 0, max_concurrency: int = 16,
                 namespace_prefix: str = "loopserve") -> None:
        super().__init__(spec.worker_id, spec.role)
        actor_cls = ray.remote(worker_class(spec.role))
        self.actor = actor_cls.options(
            name=f"{namespace_prefix}-{spec.worker_id}",
            num_cpus=spec.num_cpus,
            num_gpus=spec.num_gpus,
            max_restarts=max_restarts,
            max_concurrency=max_concurrency,
            runtime_env={"env_vars": dict(spec.env)} if spec.env else None,
        ).remote(**spec.kwargs())

    def _call(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        ref = getattr(self.actor, method).remote(*args)
        try:
            return ray.get(ref, timeout=timeout)
        except RayTaskError as e:
            cause = e.cause
            if isinstance(cause, BaseException):
                raise cause from None
            raise
        except GetTimeoutError:
            raise TimeoutError(f"{self.worker_id}.{method} did not answer within {timeout} s") from None

    def wait_ready(self, timeout: float) -> dict:
        try:
            return self.health(timeout=timeout)
        except RayActorError as e:  # the constructor raised (bad config, NIXL missing, ...)
            raise RuntimeError(f"worker {self.worker_id} failed to start: {e}") from None

    def kill(self) -> None:
        ray.kill(self.actor, no_restart=True)

    def restart(self) -> None:
        """Kill the actor as a crash would: Ray starts it again while it has restarts left
        (ray.max_restarts), else it stays dead."""
        ray.kill(self.actor, no_restart=False)
