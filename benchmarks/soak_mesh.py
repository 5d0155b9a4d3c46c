"""The mesh a soak runs: every deltamesh service as a real process in the soak's emulated regions.

Three regions (soak_net.py): `us` (host core) has the origin gateway and pool us-1, `eu` a relay of the
origin and pools eu-1 and eu-2, `ap` a relay of eu and pool ap-1 (`--vllm`: also pool eu-v, on vLLM's
CPU build). Two brokers, one active and one standing by, share a PostgreSQL database on a primary with a
synchronous streaming standby (`PgPair`); the trainer trains the tiny digit-sum model of `deltamesh
demo` and publishes every step (a full snapshot every 10 versions), checkpointing every version. TLS
and tokens are on as the demo sets them up (mesh/demo/security.py), with certificates for the hosts'
addresses. Each gateway's store is a 64 MiB tmpfs of its own, so a full disk can be made for it alone;
each pool appends what the broker acknowledged to its ledger (`[pool.worker] ledger`), which the
checks compare with the database. Each service preloads the clock shim (soak_clock.py).

`SoakMesh.start` launches everything through the demo's launcher (mesh/demo/processes.py), each
service inside its host's namespace; `restart` brings a killed one back with the same command, and
`hide_gateway`/`unhide_gateway` move a relay's real gateway to a loopback port while a malicious
stand-in (soak_hostile.py) takes its address.
"""

from __future__ import annotations

import json
import logging
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import tomli_w
from postgres_cluster import PostgresCluster
from soak_clock import ClockFiles
from soak_net import SoakNet

from deltamesh.delta import generate_key, save_keypair
from deltamesh.mesh.demo.config import DemoConfig
from deltamesh.mesh.demo.processes import Service, ServiceSet
from deltamesh.mesh.demo.security import MeshCredentials, make_credentials
from deltamesh.mesh.workflows.verifiable_math import digit_sum_tasks

log = logging.getLogger(__name__)

MODEL = "policy"
GATEWAY_PORT, HIDDEN_PORT, TRAINER_METRICS_PORT = 8700, 8701, 8720
BROKER_PORTS = (8800, 8801)
POOL_PORT = 8710
STORE_MIB = 64
MAX_STALENESS = 4
"""The broker's staleness bound on the batches it serves (invariant 5 checks it held)."""


@dataclass(frozen=True)
class Region:
    name: str
    host: str
    upstream: str = ""


REGIONS = (Region("us", "core"), Region("eu", "eu", "us"), Region("ap", "ap", "eu"))
POOLS = (("us-1", "us"), ("eu-1", "eu"), ("eu-2", "eu"), ("ap-1", "ap"))
VLLM_POOL = ("eu-v", "eu")


class PgPair:
    """PostgreSQL primary and synchronous standby on two fixed ports; a failover swaps their roles."""

    def __init__(self) -> None:
        self.primary = PostgresCluster.start_new()
        self.standby: PostgresCluster | None = PostgresCluster.start_standby(self.primary)
        self._spare_port = self.standby.port
        self.primary.set_setting("synchronous_standby_names", "*")
        self.dbname = "soak"
        self.primary.create_database(self.dbname)

    @property
    def dsn(self) -> str:
        """Both servers; libpq connects to whichever accepts writes."""
        ports = sorted({self.primary.port, self.standby.port if self.standby else self._spare_port})
        hosts = ",".join(f"127.0.0.1:{port}" for port in ports)
        return f"postgresql://postgres@{hosts}/{self.dbname}?target_session_attrs=read-write"

    @property
    def primary_dsn(self) -> str:
        return self.primary.dsn_for(self.dbname)

    def fail_over(self) -> None:
        """Crash the primary (immediate stop: no checkpoint, clients cut off), promote the standby, then
        build a new standby of it on the dead primary's port. Every commit acknowledged before the crash
        was on the standby too (synchronous replication); while the new standby is built the new primary
        commits alone, so no second failover may come before `fail_over` returns. Should the last build
        have failed, this one only builds the standby (a crash with none would lose acknowledged data)."""
        if self.standby is None:
            self._new_standby(self._spare_port)
            return
        dead = self.primary
        if dead.running():
            dead.stop(mode="immediate")
        self.standby.promote()
        self.primary, self.standby = self.standby, None
        self.primary.set_setting("synchronous_standby_names", "")
        dead.close()
        self._new_standby(dead.port)

    def _new_standby(self, port: int) -> None:
        self._spare_port = port
        self.standby = PostgresCluster.start_standby(self.primary, port=port)
        self.primary.set_setting("synchronous_standby_names", "*")

    def data_dirs(self) -> list[Path]:
        return [c.data for c in (self.primary, self.standby) if c is not None]

    def close(self) -> None:
        for c in (self.standby, self.primary):
            if c is not None:
                c.close()


@dataclass
class SoakMesh:
    run_dir: Path
    net: SoakNet
    vllm: bool = False
    services: ServiceSet = field(default_factory=ServiceSet)
    creds: MeshCredentials | None = None
    pg: PgPair | None = None
    clock: ClockFiles | None = None
    gateways: dict[str, Service] = field(default_factory=dict)
    pools: dict[str, Service] = field(default_factory=dict)
    brokers: list[Service] = field(default_factory=list)
    trainer: Service | None = None
    pool_regions: dict[str, str] = field(default_factory=dict)
    hidden: set[str] = field(default_factory=set)
    """Regions whose real gateway listens on loopback while a malicious stand-in has its address."""
    _mounts: list[Path] = field(default_factory=list)

    # -- where things are ----------------------------------------------------------------------
    def region(self, name: str) -> Region:
        return next(r for r in REGIONS if r.name == name)

    def host_of_region(self, region: str) -> str:
        return self.region(region).host

    def gateway_url(self, region: str) -> str:
        return f"https://{self.net.ip(self.host_of_region(region))}:{GATEWAY_PORT}"

    @property
    def broker_urls(self) -> list[str]:
        return [f"https://{self.net.ip('core')}:{port}" for port in BROKER_PORTS]

    def pool_url(self, pool: str) -> str:
        index = list(self.pool_regions).index(pool)
        return f"http://{self.net.ip(self.host_of_region(self.pool_regions[pool]))}:{POOL_PORT + index}"

    def store(self, region: str) -> Path:
        return self.run_dir / "stores" / region

    def pool_dir(self, pool: str) -> Path:
        return self.run_dir / "pools" / pool

    def ledger(self, pool: str) -> Path:
        return self.run_dir / "ledgers" / f"{pool}.jsonl"

    @property
    def steps_file(self) -> Path:
        return self.run_dir / "trainer" / "steps.jsonl"

    @property
    def public_key(self) -> Path:
        return self.run_dir / "keys" / "trainer.key.pub"

    def token(self, caller: str) -> str:
        assert self.creds is not None
        return self.creds.tokens[caller]

    @property
    def model_dir(self) -> Path:
        from deltamesh.mesh.demo import models

        return models.tiny_model_dir(models.VLLM_TINY if self.vllm else models.TinyModelConfig())

    # -- setting up ------------------------------------------------------------------------------
    def prepare(self) -> None:
        """Keys, credentials, tasks, the stores' filesystems, PostgreSQL; nothing of the mesh runs yet."""
        (self.run_dir / "keys").mkdir(parents=True, exist_ok=True)
        save_keypair(generate_key(), self.run_dir / "keys" / "trainer.key")
        pools = list(POOLS) + ([VLLM_POOL] if self.vllm else [])
        self.pool_regions = dict(pools)
        hosts = {f"gateway-{r.name}": [self.net.ip(r.host), "127.0.0.1"] for r in REGIONS}
        hosts["broker"] = [self.net.ip("core")]
        self.creds = make_credentials(self.run_dir / "pki", [r.name for r in REGIONS], list(self.pool_regions),
                                      [MODEL], hosts=hosts)
        recipe = DemoConfig()
        tasks = digit_sum_tasks(2000, seed=0, max_digit=recipe.max_digit)
        (self.run_dir / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
        for r in REGIONS:
            self.store(r.name).mkdir(parents=True, exist_ok=True)
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={STORE_MIB}m", f"soak-{r.name}",
                            str(self.store(r.name))], check=True)
            self._mounts.append(self.store(r.name))
        (self.run_dir / "ledgers").mkdir(exist_ok=True)
        self.clock = ClockFiles(self.run_dir / "clock")
        self.pg = PgPair()
        self.model_dir  # noqa: B018 - the property builds it, before the services race to build it

    def _service(self, name: str, kind: str, host: str, args: list[str], *, url: str = "",
                 secrets: dict[str, str] | None = None) -> Service:
        """`secrets`: tokens by environment variable, never on the command line (ps) nor in a config file."""
        assert self.clock is not None
        return Service(name, kind, args, self.run_dir / "logs" / f"{name}.log", url=url,
                       prefix=self.net.netns_prefix(host), env={**self.clock.env(name), **(secrets or {})})

    def _write_toml(self, path: Path, tables: dict) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(tomli_w.dumps(tables).encode())
        return path

    # -- the services' commands ------------------------------------------------------------------
    def gateway_args(self, region: str) -> list[str]:
        assert self.creds is not None
        r = self.region(region)
        ip = self.net.ip(r.host)
        cert = self.creds.certs[f"gateway-{region}"]
        args = ["gateway", "--region", region, "--store", str(self.store(region)),
                "--trusted-key", str(self.public_key), "--probe-interval-s", "1", "--heartbeat-timeout-s", "10",
                "--stall-timeout-s", "10", "--piece-wait-s", "2", "--disk-margin-mib", "4",
                "--tokens-file", str(self.creds.tokens_file), "--ca", str(self.creds.ca)]
        if region in self.hidden:  # behind a stand-in on its address: plain HTTP on loopback
            args += ["--listen", f"127.0.0.1:{HIDDEN_PORT}", "--advertise", self.gateway_url(region)]
        else:
            args += ["--listen", f"{ip}:{GATEWAY_PORT}", "--advertise", self.gateway_url(region),
                     "--tls-cert", str(cert.cert), "--tls-key", str(cert.key)]
        if r.upstream:
            args += ["--upstream", self.gateway_url(r.upstream)]  # its token: $DELTAMESH_UPSTREAM_TOKEN
        return args

    def broker_args(self, index: int) -> list[str]:
        assert self.creds is not None and self.pg is not None
        recipe = DemoConfig()
        config = self._write_toml(self.run_dir / "brokers" / "broker.toml", {"broker": {
            "models": [MODEL], "durability": "fsync",
            "tasks": {"dataset": str(self.run_dir / "tasks.jsonl"), "n_samples": recipe.group_size,
                      "epochs": 10000, "lease_timeout_s": 60.0, "max_lease_batch": 4,
                      "max_buffered_groups": recipe.buffered_groups},
            "policies": {"max_staleness": MAX_STALENESS},
        }})
        url = self.broker_urls[index]
        return ["broker", "--config", str(config), "--listen", url.removeprefix("https://"), "--db", self.pg.dsn,
                "--advertise-url", url, *self.creds.server_flags("broker")]

    def trainer_args(self) -> list[str]:
        recipe = DemoConfig()
        config = self._write_toml(self.run_dir / "trainer" / "trainer.toml", {"trainer": {
            "model_id": MODEL, "seed": 0, "broker": ",".join(self.broker_urls), "gateway": self.gateway_url("us"),
            "tls": {"ca": str(self.creds.ca)} if self.creds else {},
            "model": str(self.model_dir), "key": str(self.run_dir / "keys" / "trainer.key"),
            "batch_size": recipe.batch_size, "full_every": 10, "poll_s": 1.0, "device": "cpu",
            "metrics_file": str(self.steps_file), "optim": {"lr": recipe.lr},
            "metrics_listen": f"127.0.0.1:{TRAINER_METRICS_PORT}",
            "checkpoint": {"dir": str(self.run_dir / "trainer" / "checkpoints"), "every": 1, "keep": 2},
        }})
        return ["train", "--config", str(config)]

    def pool_args(self, name: str, index: int) -> list[str]:
        assert self.creds is not None
        recipe = DemoConfig()
        region = self.pool_regions[name]
        engine = "vllm" if (name, region) == VLLM_POOL else "transformers"
        config = self._write_toml(self.run_dir / "pools" / f"{name}.toml", {"pool": {
            "name": name, "broker": ",".join(self.broker_urls),
            "dir": str(self.pool_dir(name)), "region": region, "engine": engine, "device": "cpu", "threads": 1,
            "seed": index, "listen": f"{self.net.ip(self.host_of_region(region))}:{POOL_PORT + index}",
            "models": [{"model_id": MODEL, "model_path": str(self.model_dir)}],
            "sync": {"gateways": [self.gateway_url(region)],
                     "trusted_keys": [str(self.public_key)], "heartbeat_s": 0.5, "stall_timeout_s": 10.0,
                     "tls": {"ca": str(self.creds.ca)}},
            "worker": {"workflow": "math", "workflow_options": recipe.workflow_options(), "lease_batch": 2,
                       "max_episodes": 4, "idle_s": 0.1, "broker_refresh_s": 0.5, "drain_s": 3.0,
                       "max_staleness": MAX_STALENESS - 1, "ledger": str(self.ledger(name))},
            "sampling": {"max_new_tokens": recipe.max_new_tokens, "temperature": 1.0},
        }})
        return ["pool", "run", "--config", str(config)]

    # -- running ---------------------------------------------------------------------------------
    def start(self) -> None:
        for index in range(len(BROKER_PORTS)):
            self.brokers.append(self.services.start(self._service(
                f"broker-{'ab'[index]}", "broker", "core", self.broker_args(index), url=self.broker_urls[index])))
        for r in REGIONS:
            self.gateways[r.name] = self.services.start(self._service(
                f"gateway-{r.name}", "gateway", r.host, self.gateway_args(r.name), url=self.gateway_url(r.name),
                secrets={"DELTAMESH_UPSTREAM_TOKEN": self.token(f"gateway/{r.name}")} if r.upstream else None))
        trainer = self.token(f"trainer/{MODEL}")
        self.trainer = self.services.start(self._service(
            "trainer", "trainer", "core", self.trainer_args(),
            secrets={"DELTAMESH_BROKER_TOKEN": trainer, "DELTAMESH_GATEWAY_TOKEN": trainer}))
        for index, (name, region) in enumerate(self.pool_regions.items()):
            self.pools[name] = self.services.start(self._service(
                f"pool-{name}", "pool", self.host_of_region(region), self.pool_args(name, index),
                url=self.pool_url(name),
                secrets={"DELTAMESH_BROKER_TOKEN": self.token(f"pool/{name}"), "DELTAMESH_TOKEN": self.token(f"pool/{name}")}))

    def restart(self, service: Service) -> None:
        self.services.restart(service)

    def hide_gateway(self, region: str) -> None:
        """Restart `region`'s gateway on loopback, plain HTTP, so a stand-in can take its address."""
        self.hidden.add(region)
        self.gateways[region].args = self.gateway_args(region)

    def unhide_gateway(self, region: str) -> None:
        self.hidden.discard(region)
        self.gateways[region].args = self.gateway_args(region)

    def all_services(self) -> list[Service]:
        return list(self.services.services)

    async def stop(self) -> None:
        early = [s for s in self.services.services if s.kind in ("pool", "trainer")]
        await self.services.stop(early, grace_s=20.0)
        await self.services.stop(grace_s=10.0)

    def close(self) -> None:
        """Everything made outside the processes: PostgreSQL, the stores' filesystems (after a stop)."""
        if self.pg is not None:
            self.pg.close()
        for mount in self._mounts:
            subprocess.run(["umount", "-l", str(mount)], check=False)
        self._mounts.clear()
