"""Workers as Ray actors: one actor per worker with its num_cpus / num_gpus.

Actors are threaded (`max_concurrency`) so a pump's long poll does not block submits and
aborts; the worker's own lock serialises the engine.
A cluster started here listens on loopback only (Ray reads that at import, so it is set
before `import ray`) and requires a token (Ray's token authentication): a fresh random one
per cluster in a 0600 file of a private directory, so no other local process can join it
and call the workers' actors. A cluster joined through an address brings its own settings.
"""

from __future__ import annotations

import logging
import os
import secrets
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def require_token() -> Path:
    """Make the next local `ray.init` start a cluster that requires a new random token;
    returns the token file (mode 0600, in a 0700 directory; the token is never logged).
    Ray reads these variables when it is imported: this runs before that."""
    path = Path(tempfile.mkdtemp(prefix="loopserve-ray-")) / "auth_token"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.environ.pop("RAY_AUTH_TOKEN", None)  # it would take precedence over the file
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)
    return path


os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
if "RAY_AUTH_MODE" not in os.environ and not os.environ.get("RAY_ADDRESS"):
    require_token()  # a caller that set RAY_AUTH_MODE (or joins RAY_ADDRESS) brings its own

import ray  # noqa: E402
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

from loopserve.cluster.config import RayConfig
from loopserve.cluster.handle import WorkerHandle
from loopserve.cluster.worker_spec import WorkerSpec, worker_class


def ensure_ray(cfg: RayConfig) -> bool:
    """Connect to the configured cluster (or RAY_ADDRESS, or start a local one); True if started here."""
    if ray.is_initialized():
        return False
    address = cfg.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, log_to_driver=False)
        return False
    if os.environ.get("RAY_AUTH_MODE") != "token":
        log.warning("starting a Ray cluster without token authentication (RAY_AUTH_MODE=%s): "
                    "any local process can call its workers", os.environ.get("RAY_AUTH_MODE"))
    ray.init(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus, include_dashboard=False,
             log_to_driver=False)
    return True



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
