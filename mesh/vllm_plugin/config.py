"""The deltamesh weight-transfer backend's settings: what `/init_weight_transfer_engine` carries.

A client of vLLM's RL API sends `{"init_info": {...}}`; vLLM hands the dict to the backend on every
worker, which reads it into `BackendConfig` with the project's one config loader (so an unknown key
or a value of the wrong type is a clear error, and nothing starts). The same table, `[vllm_backend]`,
may come from a TOML file named by `$DELTAMESH_VLLM_BACKEND` instead, read when vLLM creates the
backend: a server that follows a gateway by itself then needs no call at all. `update_info` of
`/update_weights` is `UpdateInfo`: the version to take, or none for the gateway's head.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from deltamesh.config import ConfigError, from_dict, http_url, load_config, split_urls
from deltamesh.config_flags import read_secret
from deltamesh.http import parse_listen
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.tls import TlsSettings

CONFIG_ENV = "DELTAMESH_VLLM_BACKEND"
"""A TOML file whose `[vllm_backend]` table initialises the backend as vLLM creates it."""
SECTION = "vllm_backend"
TOKEN_ENV = "DELTAMESH_TOKEN"


@dataclass
class BackendConfig:
    """The engine side of the backend (`init_info`; docs/ENGINES.md, "vLLM's RL API")."""

    gateway: str | list[str]
    """The region's gateway URL, or several: the first is asked first, the others when it fails."""
    model: str
    """The model id whose versions this server takes."""
    trusted_key: str | list[str]
    """PEM file(s) of the trainer public key(s) whose signed versions are accepted."""
    token_file: str = ""
    """File holding the pool token (role pool) sent to the gateways; empty: $DELTAMESH_TOKEN, or none when a
    client certificate (`tls_cert`) identifies the server."""
    ca: str = ""
    """PEM bundle verifying https:// gateways; empty: the system store."""
    tls_cert: str = ""
    """PEM client certificate (common name pool/NAME) for gateways that require one (mTLS)."""
    tls_key: str = ""
    """PEM private key of `tls_cert`."""
    insecure: bool = False
    """Allow the token over plain http:// to hosts that are not loopback."""
    name: str = ""
    """Pool name the server registers and heartbeats under at its gateway (the name its token was issued
    for); empty: a name is only sent as the peer label `vllm`, and nothing registers."""
    follow: bool = False
    """Follow the gateway's head without a trainer: each new version is taken through this server's own
    RL routes at `server` (the backend calls them itself)."""
    server: str = ""
    """This vLLM server's base URL as the backend reaches it (follow mode), e.g. http://127.0.0.1:8000."""
    metrics_listen: str = ""
    """Serve Prometheus `/metrics` and `/v1/status` (version, head, proof) on HOST:PORT; empty: off.
    Read-only and unauthenticated: bind it to loopback or the scraper's network."""
    wait_s: float = 60.0
    """How long an update of a named version waits for a gateway to announce it."""
    check: bool = True
    """Read vLLM's parameters back after every update and compare them with the signed hashes."""
    connections: int = 4
    """Parallel piece fetches per transfer."""
    poll_wait_s: float = 30.0
    """Longest wait of one long poll for a new head (follow mode)."""
    stall_timeout_s: float = 20.0
    """A gateway that sends no byte for this long is treated as stalled and an alternate is tried."""
    give_up_s: float = 120.0
    """How long a piece may stay unavailable from every gateway before the update fails."""
    stale_after_s: float = 60.0
    """Freeze check: a gateway whose head stays below a version known elsewhere this long is flagged stale."""
    statement_max_age_s: float = 0.0
    """Require each gateway's signed head statement to be at most this old; 0: not required."""

    def __post_init__(self) -> None:
        self.gateway = [http_url(u, "gateway") for u in split_urls(self.gateway)]
        if not self.gateway:
            raise ValueError("gateway must name at least one gateway URL")
        self.trusted_key = [self.trusted_key] if isinstance(self.trusted_key, str) else list(self.trusted_key)
        if not self.model:
            raise ValueError("model is required (the model id to take versions of)")
        if self.follow and not self.server:
            raise ValueError("follow needs server: this vLLM server's base URL, whose RL routes the backend calls")
        if self.server:
            self.server = http_url(self.server, "server")
        if self.metrics_listen:
            parse_listen(self.metrics_listen)
        if self.wait_s < 0:
            raise ValueError("wait_s must be >= 0")

    def token(self) -> str:
        if self.token_file:
            return read_secret(self.token_file, "token_file")
        return os.environ.get(TOKEN_ENV, "")

    def sync_config(self, model_dir: str) -> PoolSyncConfig:
        """The pool-side weight sync these settings describe; `model_dir` is the directory vLLM loaded,
        whose deltamesh manifest (if any) names the version it holds."""
        tls = TlsSettings(cert=self.tls_cert, key=self.tls_key, ca=self.ca, insecure=self.insecure)
        return PoolSyncConfig(
            gateways=list(self.gateway), token=self.token(), trusted_keys=list(self.trusted_key), tls=tls,
            name=self.name or "vllm", dir=model_dir, model=self.model, engine="vllm", endpoint=self.server,
            connections=self.connections, poll_wait_s=self.poll_wait_s, stall_timeout_s=self.stall_timeout_s,
            give_up_s=self.give_up_s, stale_after_s=self.stale_after_s,
            statement_max_age_s=self.statement_max_age_s)


@dataclass
class UpdateInfo:
    """`update_info` of `/update_weights`."""

    version: int | None = None
    """The version to take; None: the gateway's head."""

    def __post_init__(self) -> None:
        if self.version is not None and (isinstance(self.version, bool) or self.version < 0):
            raise ValueError(f"version must be a version number >= 0, got {self.version!r}")


def parse_backend_config(init_info: dict) -> BackendConfig:
    """`init_info` as `BackendConfig`; ConfigError (a ValueError) naming what is wrong."""
    return from_dict(BackendConfig, init_info, where="init_info")


def parse_update_info(update_info: dict) -> UpdateInfo:
    return from_dict(UpdateInfo, update_info, where="update_info")


def config_from_env() -> BackendConfig | None:
    """The `[vllm_backend]` table of the file `$DELTAMESH_VLLM_BACKEND` names, if it names one."""
    path = os.environ.get(CONFIG_ENV, "")
    if not path:
        return None
    try:
        return load_config(BackendConfig, path, section=SECTION)
    except ConfigError as e:
        raise ConfigError(f"${CONFIG_ENV}: {e}") from e
