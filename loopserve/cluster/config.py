"""ClusterConfig: which workers to start where, and how they serve. YAML, unknown keys are errors.

The defaults are the embedded default cluster (`configs/cpu-1p1d.yaml`: one prefill and one
decode worker of the tiny trained model `tiny-ouro-chains` on a local CPU Ray cluster).
"""

from __future__ import annotations

import os
import argparse
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, model_validator

from loopserve.cluster.router.policy import RoutingPolicy, make_policy
from loopserve.config_file import ConfigError, describe, read_yaml
from loopserve.engine.config import DEFAULT_MODEL, EngineConfig, given_scheduler_keys, merge_engine_data
from loopserve.kv_transfer.registry import DEFAULT_CONNECTOR, KVConnectorName
from loopserve.protocol.limits import RequestLimits

AUTH_TOKEN_ENV = "LOOPSERVE_AUTH_TOKEN"
LOCAL_PREFILL_TOKENS = 0
ROLES_BY_MODE = {"pd": ("prefill", "decode"), "colocated": ("colocated",)}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkerGroup(_Strict):
    num_workers: int = Field(1, ge=0)
    num_cpus: float = Field(1.0, ge=0)  # per worker (Ray actor resource)
    num_gpus: float = Field(0.0, ge=0)  # per worker; fractions share a GPU
    engine: dict = Field(default_factory=dict)  # EngineConfig overrides for this group


class RayConfig(_Strict):
    # None: RAY_ADDRESS if set (ray job submit), else a private local cluster of this server
    address: str | None = None
    num_cpus: int | None = Field(None, ge=1)  # local cluster only
    num_gpus: int | None = Field(None, ge=0)  # local cluster only
    max_concurrency: int = Field(16, ge=2)  # long polls + submits + aborts at once


class TransferConfig(_Strict):
    connector: KVConnectorName = DEFAULT_CONNECTOR  # the KV transport (kv_transfer/registry.py)
    lease_s: float = Field(30.0, gt=0)  # prefill frees a handoff's blocks if not renewed this long
    heartbeat_s: float = Field(1.0, gt=0)  # decode renews leases of handoffs it still has to read
    read_timeout_s: float = Field(30.0, gt=0)  # a READ not done by then fails the request
    # One UCX progress thread per NIXL agent spins a CPU core; off, each worker's step loop
    # drives NIXL itself every tick (what CPU clusters want; on GPU hosts cores are plenty).
    progress_thread: bool = False

    @model_validator(mode="after")
    def _check(self) -> TransferConfig:
        if self.heartbeat_s >= self.lease_s:
            raise ValueError(f"transfer.heartbeat_s ({self.heartbeat_s}) must be < "
                             f"transfer.lease_s ({self.lease_s})")
        return self


class RoutingConfig(_Strict):
    policy: str = "prefix_aware"
    params: dict[str, int | float | str | bool] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> RoutingConfig:
        self.build()  # ValueError names the unknown policy or parameter
        return self

    def build(self) -> RoutingPolicy:
        return make_policy(self.policy, self.params)


def _env_token() -> SecretStr | None:
    token = os.environ.get(AUTH_TOKEN_ENV)
    return SecretStr(token) if token else None


class ServerConfig(_Strict):
    host: str = "127.0.0.1"  # loopback only unless asked: plaintext and no token by default
    port: int = Field(50051, ge=0, le=65535)  # gRPC; 0: any free port
    http_port: int | None = Field(8000, ge=0, le=65535)  # OpenAI-compatible HTTP; None: off
    poll_s: float = Field(0.2, gt=0)  # long-poll period of the router's pumps
    max_migrations: int = Field(2, ge=0)  # times a request may move after a worker failure
    # Which worker gets a request: a policy of cluster/router/policy.py by name, with its
    # fields (prefix_aware: where the workers' prefix caches hold the longest part of the
    # prompt, among workers near the least loaded; least_loaded: by load alone).
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    # pd mode: a request whose uncached prompt is shorter than this many tokens is prefilled on
    # its decode worker, with no KV transfer; 0: every request is disaggregated. The default
    # is the measured crossover of prefill and transfer time (docs/benchmarks.md).
    local_prefill_tokens: int = Field(LOCAL_PREFILL_TOKENS, ge=0)
    # A call to a worker (or its event poll) unanswered this long: the worker is routed around
    # and the call goes elsewhere; unanswered for worker_fail_s: failed, its requests migrate.
    # Polls never wait for the engine, but calls wait for its current step: an overloaded
    # worker in eager GPU mode kept a submit waiting > 5 s (H100, 52d7f2a), hence 10 s.
    worker_deadline_s: float = Field(10.0, gt=0)
    worker_fail_s: float = Field(30.0, gt=0)
    # Generate streams in flight; beyond, new ones get RESOURCE_EXHAUSTED at once (the other
    # RPCs still answer, so health checks work under overload).
    max_pending_requests: int = Field(4096, ge=1)
    limits: RequestLimits = Field(default_factory=RequestLimits)
    # Every RPC must carry `authorization: Bearer <token>`; default: $LOOPSERVE_AUTH_TOKEN.
    auth_token: SecretStr | None = Field(default_factory=_env_token)
    tls_cert_file: Path | None = None  # PEM; with tls_key_file: TLS instead of plaintext
    tls_key_file: Path | None = None
    tls_client_ca_file: Path | None = None  # PEM; clients must present a cert it signed (mTLS)
    # HTTP: a Jinja chat template file for a model whose checkpoint has none (vLLM's
    # --chat-template); without either, /v1/chat/completions is a 400 saying so.
    chat_template: Path | None = None
    # HTTP slow clients: a request's headers must arrive within http_header_timeout_s of the
    # connection being ready for it, its body within http_body_timeout_s of its headers; an
    # idle keep-alive connection is closed after http_keep_alive_s. Else the socket is closed.
    http_header_timeout_s: float = Field(10.0, gt=0)
    http_body_timeout_s: float = Field(30.0, gt=0)
    http_keep_alive_s: float = Field(5.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        if self.auth_token is not None and not self.auth_token.get_secret_value():
            raise ValueError("server.auth_token must not be empty (leave it unset for no auth)")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("server.tls_cert_file and server.tls_key_file go together")
        if self.worker_fail_s < self.worker_deadline_s:
            raise ValueError(f"server.worker_fail_s ({self.worker_fail_s}) must be >= "
                             f"server.worker_deadline_s ({self.worker_deadline_s})")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ValueError("server.tls_client_ca_file needs server.tls_cert_file and tls_key_file")
        for key in ("tls_cert_file", "tls_key_file", "tls_client_ca_file", "chat_template"):
            path = getattr(self, key)
            if path is not None and not path.is_file():
                raise ValueError(f"server.{key} {str(path)!r} does not exist")
        return self

    @property
    def tls(self) -> bool:
        return self.tls_cert_file is not None


def _default_engine() -> EngineConfig:
    return EngineConfig(model=DEFAULT_MODEL, block_size=4, num_blocks=2048, max_model_len=512,
                        max_num_seqs=32)


class ClusterConfig(_Strict):
    mode: Literal["pd", "colocated"] = "pd"
    launcher: Literal["ray", "process"] = "ray"
    # Times a failed worker (dead, its engine failed, or silent past server.worker_fail_s) is
    # started again: Ray restarts the actor, the process launcher starts a new process.
    max_restarts: int = Field(3, ge=0)
    engine: EngineConfig = Field(default_factory=_default_engine)  # shared by every worker
    prefill: WorkerGroup = Field(default_factory=WorkerGroup)
    decode: WorkerGroup = Field(default_factory=WorkerGroup)
    colocated: WorkerGroup = Field(default_factory=WorkerGroup)
    ray: RayConfig = Field(default_factory=RayConfig)
    transfer: TransferConfig = Field(default_factory=TransferConfig)
    server: ServerConfig = Field(default_factory=ServerConfig)

    @model_validator(mode="after")
    def _check(self) -> ClusterConfig:
        if "role" in self.engine.scheduler.model_fields_set:
            raise ValueError("engine.role is set by the worker group; remove it")
        for role in ROLES_BY_MODE[self.mode]:
            if getattr(self, role).num_workers < 1:
                raise ValueError(f"{role}.num_workers must be >= 1 in mode {self.mode!r}")
            self.engine_config(role)  # validates the group's overrides
        return self

    def roles(self) -> tuple[str, ...]:
        return ROLES_BY_MODE[self.mode]

    def group(self, role: str) -> WorkerGroup:
        return getattr(self, role)

    def engine_config(self, role: str) -> EngineConfig:
        """The shared engine config with the group's overrides, for `role`."""
        overrides = self.group(role).engine
        if "role" in given_scheduler_keys(overrides):
            raise ValueError(f"{role}.engine.role is set by the worker group; remove it")
        base = self.engine.model_dump(exclude={"scheduler": {"role"}})
        try:
            return EngineConfig(**merge_engine_data(base, {**overrides, "role": role}))
        except ValidationError as e:
            raise ValueError(describe(e, f"{role}.engine: ")) from None


def load_cluster_config(source: str | Path | dict | None = None, **overrides) -> ClusterConfig:
    """A ClusterConfig from a YAML path, a dict or nothing (the embedded default)."""
    if isinstance(source, (str, Path)):
        data, where = read_yaml(source), f"{source}: "
    else:
        data, where = dict(source or {}), ""
    data.update(overrides)
    try:
        return ClusterConfig(**data)
    except ValidationError as e:
        raise ConfigError(describe(e, where)) from None


SERVER_FLAGS = {"host": "host", "port": "port", "http_port": "http_port", "tls_cert": "tls_cert_file", "tls_key": "tls_key_file",
                "tls_client_ca": "tls_client_ca_file"}


def server_overrides(config: ClusterConfig, args: argparse.Namespace) -> ClusterConfig:
    """The config's `server` with the command line's flags on top, validated like the YAML."""
    overrides = {key: v for flag, key in SERVER_FLAGS.items() if (v := getattr(args, flag)) is not None}
    if not overrides:
        return config
    if overrides.get("http_port") == -1:  # --http-port -1: no HTTP server
        overrides["http_port"] = None
    try:
        server = ServerConfig.model_validate({**config.server.model_dump(), **overrides})
    except ValidationError as e:
        raise ConfigError(describe(e, "command line: ")) from None
    return config.model_copy(update={"server": server})


def add_server_args(p: argparse.ArgumentParser) -> None:
    """Flags over the config's `server` section (the bearer token stays in YAML or the env:
    a flag would show it in the process list)."""
    p.add_argument("--host", default=None, help="address both fronts bind (default: the config's "
                   "server.host, 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="gRPC port (default: the config's server.port, 50051)")
    p.add_argument("--http-port", type=int, default=None,
                   help="OpenAI-compatible HTTP port; -1: no HTTP server (default: the config's "
                   "server.http_port, 8000)")
    p.add_argument("--tls-cert", default=None, help="server certificate PEM (with --tls-key): TLS")
    p.add_argument("--tls-key", default=None, help="server private key PEM")
    p.add_argument("--tls-client-ca", default=None, help="require client certificates signed by this CA (mTLS)")
