"""Laying out and starting the demo mesh: keys, task set, config files, then every service as a process.

`prepare` writes everything the services read into the run directory: the trainer's Ed25519 key
pair, the task set (digit sums, or for a code workflow its code problems, which the broker cycles
through as many epochs as the run needs), and one TOML file per broker, trainer and pool (written
with the services' own config tables, so each one's settings can be read and rerun by hand; mode
0600). No token goes in those files or on a command line, where every user of the host sees it
(`ps`): each service reads its own from a token file (`--token-file` and the like, mode 0600). `start` then
launches the broker, the gateways in topology order (each relay gets its link's bandwidth cap and
added latency), the pools and the trainers, all on free loopback ports; they find each other through
the URLs given here and retry until their peers answer, so they boot side by side.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import socket
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import tomli_w

from deltamesh.config import to_dict
from deltamesh.delta import generate_key, save_keypair
from deltamesh.mesh.demo.config import DemoConfig
from deltamesh.mesh.demo.processes import Service, ServiceSet, free_port
from deltamesh.mesh.demo.security import MeshCredentials, make_credentials
from deltamesh.mesh.demo.topology import GatewaySpec
from deltamesh.mesh.workflows import arithmetic
from deltamesh.mesh.workflows.code_tasks import CodeProblem, humaneval_problems, synthetic_problems, write_tasks
from deltamesh.mesh.workflows.verifiable_math import digit_sum_tasks
from deltamesh.tokens import save_token

EVALUATOR = "eval"
"""The demo evaluator's name (at its gateway, where it registers as a pool of tier `eval`)."""
CONSOLE_PORT = 8790
"""Where the demo serves its web console when the port is free (else any free one)."""


@dataclass
class MeshPlan:
    """Where everything of one run lives, and the services once started."""

    config: DemoConfig
    run_dir: Path
    model_dir: Path
    private_key: Path
    public_key: Path
    pool_token: Path
    """The file of the pools' token on an anonymous (plain-HTTP) mesh, where gateways take any."""
    epochs: int = 1
    """Passes the broker makes over tasks.jsonl (a small code set is cycled through)."""
    creds: MeshCredentials | None = None
    """The run's CA, server certificates and tokens; None for a plain-HTTP, anonymous mesh."""
    broker: Service | None = None
    gateways: dict[str, Service] = field(default_factory=dict)
    """Region -> its gateway."""
    pools: dict[str, Service] = field(default_factory=dict)
    trainers: dict[str, Service] = field(default_factory=dict)
    """model_id -> its trainer."""
    evaluator: Service | None = None
    """The evaluator of the first policy (when `[demo.eval] every` > 0)."""
    trainer_metrics: dict[str, str] = field(default_factory=dict)
    """model_id -> the URL its trainer serves its metrics at (the console reads each pool's mismatch there)."""
    console: Service | None = None

    def metrics_file(self, model_id: str) -> Path:
        return self.run_dir / "trainer" / f"{model_id}.steps.jsonl"

    def pool_dir(self, pool: str) -> Path:
        return self.run_dir / "pools" / pool

    def registration(self, pool: str, model_id: str) -> str:
        """The name a pool's weight stream registers with at its gateway (see PoolConfig)."""
        return pool if len(self.config.model_ids) == 1 else f"{pool}.{model_id}"

    @property
    def scheme(self) -> str:
        return "https" if self.creds is not None else "http"

    def token(self, caller: str) -> str:
        """The token of `caller` (`pool/NAME`, `trainer/MODEL`, `gateway/REGION`, `admin`); "" without TLS."""
        return self.creds.tokens[caller] if self.creds is not None else ""

    def token_file(self, caller: str) -> Path | None:
        """The file (mode 0600) holding the token of `caller`; None without TLS."""
        return self.creds.token_files[caller] if self.creds is not None else None

    def tls_table(self) -> dict[str, str]:
        """The `[SECTION.tls]` table of a client config: the run's CA, or nothing."""
        return {"ca": str(self.creds.ca)} if self.creds is not None else {}

    @property
    def services(self) -> list[Service]:
        out = [self.broker] if self.broker is not None else []
        out += [*self.gateways.values(), *self.pools.values(), *self.trainers.values()]
        return out + [s for s in (self.evaluator, self.console) if s is not None]


def model_dir(model: str, engine: str = "transformers") -> Path:
    """The model's bf16 Hugging Face directory (built into the cache on first use); the tiny model of
    a vLLM demo has the head size vLLM's CPU kernels need."""
    from deltamesh.mesh.demo import models

    if model == "tiny":
        return models.tiny_model_dir(models.VLLM_TINY if engine == "vllm" else models.TinyModelConfig())
    return models.smollm2_model_dir()


def prepare(config: DemoConfig, run_dir: Path) -> MeshPlan:
    run_dir.mkdir(parents=True, exist_ok=True)
    key_path = run_dir / "keys" / "trainer.key"
    key_path.parent.mkdir(exist_ok=True)
    public = save_keypair(generate_key(), key_path)
    pool_token = run_dir / "keys" / "pool.token"
    save_token(pool_token, secrets.token_hex(16), replace=True)
    plan = MeshPlan(config, run_dir, model_dir(config.model, config.engine), key_path, Path(public), pool_token)
    if config.tls:
        plan.creds = make_credentials(run_dir / "pki", [g.region for g in config.topology.gateways],
                                      [p.name for p in config.topology.pools], list(config.model_ids),
                                      evaluator=EVALUATOR if config.eval.every else "")
    # Enough prompts that the trainers never run dry (backpressure keeps production near consumption).
    count = (config.steps + 20) * config.groups_per_step * 4
    if config.needs_sandbox:
        plan.epochs = math.ceil(count / write_tasks(code_problems(config.code_tasks), run_dir / "tasks.jsonl"))
        return plan
    if config.tasks == "arithmetic":  # the training split only: the evaluator's held-out problems never appear
        tasks = arithmetic.train_tasks(count, config.levels, seed=config.seed, wording=config.wording)
        plan.epochs = math.ceil(count / len(tasks))  # each problem once per pass: a dataset's ids are unique
    else:
        tasks = digit_sum_tasks(count, seed=config.seed, max_digit=config.max_digit)
    (run_dir / "tasks.jsonl").write_text("".join(json.dumps(t) + "\n" for t in tasks))
    return plan


def code_problems(source: str) -> list[CodeProblem]:
    return humaneval_problems() if source == "humaneval" else synthetic_problems()


def _write_toml(path: Path, tables: dict) -> Path:
    """A service's config file, readable by its owner only (it names keys and paths of the run)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(fd, 0o600)
        f.write(tomli_w.dumps(tables).encode())
    return path


def _http(name: str, kind: str, args: list[str], log_path: Path, port: int, scheme: str = "http") -> Service:
    return Service(name, kind, args, log_path, url=f"{scheme}://127.0.0.1:{port}", ports=[port])


def broker_service(plan: MeshPlan) -> Service:
    cfg, port = plan.config, free_port()
    # A code episode of the real model (several generations of up to 64 tokens on one thread, then
    # sandbox runs) can take minutes: its lease must outlive it, or the task goes out twice meanwhile.
    lease_timeout_s = 600.0 if cfg.needs_sandbox else 60.0
    config = _write_toml(plan.run_dir / "broker" / "broker.toml", {"broker": {
        "models": list(cfg.model_ids), "durability": "process",
        "tasks": {"dataset": str(plan.run_dir / "tasks.jsonl"), "n_samples": cfg.group_size, "epochs": plan.epochs,
                  "lease_timeout_s": lease_timeout_s, "max_lease_batch": 4, "max_buffered_groups": cfg.buffered_groups},
        **({"policies": {"max_staleness": cfg.max_staleness}} if cfg.max_staleness is not None else {}),
    }})
    args = ["broker", "--listen", f"127.0.0.1:{port}", "--db", str(plan.run_dir / "broker" / "broker.db"),
            "--config", str(config)]
    args += plan.creds.server_flags("broker") if plan.creds is not None else ["--anonymous"]
    return _http("broker", "broker", args, plan.run_dir / "logs" / "broker.log", port, plan.scheme)


def gateway_service(plan: MeshPlan, spec: GatewaySpec) -> Service:
    port = free_port()
    url = f"{plan.scheme}://127.0.0.1:{port}"
    args = ["gateway", "--region", spec.region, "--listen", f"127.0.0.1:{port}", "--advertise", url,
            "--store", str(plan.run_dir / "gateways" / spec.region), "--trusted-key", str(plan.public_key),
            "--probe-interval-s", "1", "--heartbeat-timeout-s", "10", "--stall-timeout-s", "10", "--piece-wait-s", "2"]
    args += plan.creds.server_flags(f"gateway-{spec.region}") if plan.creds is not None else ["--anonymous"]
    if spec.upstream:
        args += ["--upstream", plan.gateways[spec.upstream].url]
        if plan.creds is not None:
            args += ["--upstream-token-file", str(plan.token_file(f"gateway/{spec.region}"))]
        if spec.bandwidth_mbps:
            args += ["--bandwidth-cap-mbps", str(spec.bandwidth_mbps)]
        if spec.delay_ms:
            args += ["--link-delay-ms", str(spec.delay_ms)]
    return _http(f"gateway-{spec.region}", "gateway", args, plan.run_dir / "logs" / f"gateway-{spec.region}.log",
                 port, plan.scheme)


def pool_service(plan: MeshPlan, name: str, region: str, index: int) -> Service:
    cfg, port = plan.config, free_port()
    assert plan.broker is not None
    config = _write_toml(plan.run_dir / "pools" / f"{name}.toml", {"pool": {
        "name": name, "broker": plan.broker.url,
        "dir": str(plan.pool_dir(name)), "region": region,
        "engine": cfg.engine, "device": "cpu", "threads": 1, "seed": cfg.seed * 1000 + index,
        "listen": f"127.0.0.1:{port}",
        "models": [{"model_id": m, "model_path": str(plan.model_dir)} for m in cfg.model_ids],
        "sync": {"gateways": [plan.gateways[region].url],
                 "trusted_keys": [str(plan.public_key)], "heartbeat_s": 0.5, "stall_timeout_s": 10.0,
                 "tls": plan.tls_table()},
        "worker": {"workflow": cfg.workflow, "workflow_options": cfg.workflow_options(), "lease_batch": 2,
                   "max_episodes": 4, "idle_s": 0.1, "broker_refresh_s": 0.5, "drain_s": 3.0,
                   **({"max_staleness": cfg.max_staleness} if cfg.max_staleness is not None else {})},
        "sampling": {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.temperature},
        **({"sandbox": to_dict(cfg.sandbox)} if cfg.needs_sandbox else {}),
    }})
    token = plan.token_file(f"pool/{name}")
    args = ["pool", "run", "--config", str(config), "--token-file", str(token or plan.pool_token)]
    if token is not None:
        args += ["--broker-token-file", str(token)]
    return _http(name, "pool", args, plan.run_dir / "logs" / f"pool-{name}.log", port)


def trainer_service(plan: MeshPlan, model_id: str) -> Service:
    cfg = plan.config
    assert plan.broker is not None
    origin = plan.gateways[cfg.topology.origin.region]
    metrics_port = free_port()
    plan.trainer_metrics[model_id] = f"http://127.0.0.1:{metrics_port}"
    config = _write_toml(plan.run_dir / "trainer" / f"{model_id}.toml", {"trainer": {
        "model_id": model_id, "seed": cfg.seed, "broker": plan.broker.url, "gateway": origin.url,
        "tls": plan.tls_table(),
        "model": str(plan.model_dir), "key": str(plan.private_key), "batch_size": cfg.batch_size,
        "max_steps": cfg.steps, "full_every": cfg.full_every, "poll_s": 1.0, "device": "cpu",
        "metrics_file": str(plan.metrics_file(model_id)), "optim": {"lr": cfg.lr},
        # Plain PPO clipping is M2PO without its second-moment bound: an infinite threshold keeps every token.
        "loss": {"kl_coef": cfg.kl_coef, "temperature": cfg.temperature or 1.0,
                 **({"m2_threshold": math.inf} if cfg.loss == "clip" else {})},
        "metrics_listen": f"127.0.0.1:{metrics_port}",
    }})
    args = ["train", "--config", str(config)]
    token = plan.token_file(f"trainer/{model_id}")
    if token is not None:
        args += ["--broker-token-file", str(token), "--gateway-token-file", str(token)]
    # The trainer may use both cores for the real model; the tiny one gains nothing from a second thread.
    return Service(f"trainer-{model_id}", "trainer", args,
                   plan.run_dir / "logs" / f"trainer-{model_id}.log", threads=1 if cfg.model == "tiny" else 2)


def heldout_table(cfg: DemoConfig) -> dict[str, Any]:
    """The evaluator's `[eval.heldout]`: HumanEval for the code workflows, else the arithmetic held-out
    split of the levels and wording the trainers' tasks have."""
    if cfg.needs_sandbox:
        return {"family": "humaneval", "problems": cfg.eval.problems}
    return {"family": "arithmetic", "problems": cfg.eval.problems, "levels": list(cfg.levels), "wording": cfg.wording}


def eval_service(plan: MeshPlan) -> Service:
    """The evaluator of the first policy: it follows `[demo.eval] region`'s gateway (the origin's by
    default) like a pool, and scores versions on the held-out set with the pools' engine."""
    cfg, port = plan.config, free_port()
    model_id = cfg.model_ids[0]
    region = cfg.eval.region or cfg.topology.origin.region
    workflow, options = cfg.eval_workflow()
    server = {"tokens_file": str(plan.creds.tokens_file),
              "tls": {"cert": str(plan.creds.certs["eval"].cert), "key": str(plan.creds.certs["eval"].key),
                      "ca": str(plan.creds.ca)}} if plan.creds is not None else {"anonymous": True}
    config = _write_toml(plan.run_dir / "eval" / "eval.toml", {"eval": {
        "name": EVALUATOR, "model_id": model_id, "model_path": str(plan.model_dir), "engine": cfg.engine,
        "threads": 1, "seed": cfg.seed, "dir": str(plan.run_dir / "eval" / "weights"),
        "db": str(plan.run_dir / "eval" / "eval.db"), "listen": f"127.0.0.1:{port}",
        "gateways": [plan.gateways[region].url],
        "trusted_keys": [str(plan.public_key)], "heartbeat_s": 1.0, "stall_timeout_s": 10.0,
        "every": cfg.eval.every, "samples": cfg.eval.samples, "heldout": heldout_table(cfg),
        "workflow": workflow, "workflow_options": options,
        "sampling": {"max_new_tokens": cfg.max_new_tokens, "temperature": cfg.eval_temperature},
        **({"sandbox": to_dict(cfg.sandbox)} if cfg.needs_sandbox else {}), **server,
    }})
    token = plan.token_file(f"pool/{EVALUATOR}") or plan.pool_token
    return _http("eval", "eval", ["eval", "--config", str(config), "--token-file", str(token)],
                 plan.run_dir / "logs" / "eval.log", port, plan.scheme)


def console_service(plan: MeshPlan) -> Service:
    """The web console, reading every gateway, the broker and the trainers' metrics as the run's admin."""
    port = CONSOLE_PORT if port_free(CONSOLE_PORT) else free_port()
    args = ["console", "--listen", f"127.0.0.1:{port}", "--poll-s", "1", "--stale-after-s", "15"]
    for spec in plan.config.topology.gateways:
        args += ["--gateway", plan.gateways[spec.region].url]
    assert plan.broker is not None
    args += ["--broker", plan.broker.url]
    for url in plan.trainer_metrics.values():
        args += ["--trainer", url]
    if plan.creds is not None:
        token = plan.run_dir / "pki" / "console.token"  # the admin's, in a file: never on a command line
        token.write_text(plan.token("admin") + "\n")
        token.chmod(0o600)
        args += ["--token-file", str(token), "--broker-token-file", str(token), "--ca", str(plan.creds.ca)]
    return _http("console", "console", args, plan.run_dir / "logs" / "console.log", port)


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def start(plan: MeshPlan, services: ServiceSet) -> None:
    """Launch every service of the plan (they come up side by side and wait for their peers)."""
    cfg = plan.config
    plan.broker = services.start(broker_service(plan))
    for spec in cfg.topology.gateways:
        plan.gateways[spec.region] = services.start(gateway_service(plan, spec))
    for model_id in cfg.model_ids:
        plan.trainers[model_id] = services.start(trainer_service(plan, model_id))
    for index, pool in enumerate(cfg.topology.pools):
        plan.pools[pool.name] = services.start(pool_service(plan, pool.name, pool.region, index))
    if cfg.eval.every:
        plan.evaluator = services.start(eval_service(plan))
    if cfg.console:
        plan.console = services.start(console_service(plan))
