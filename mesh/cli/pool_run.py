"""`deltamesh pool run`: a rollout pool (engines kept at the gateway's head, and a rollout worker)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    p = pool_commands.add_parser(
        "run", help="run a rollout pool: weight sync, engine and rollout worker",
        description="Start a rollout pool: its engines follow the region's gateway (hot swap in place where the "
                    "engine can), and its worker leases tasks from the broker, runs the workflow and submits "
                    "trajectories. Flags override the [pool] table of --config (see mesh/pool/config.py); "
                    "a pool of several policies is described there ([[pool.models]]) or with --model-id repeated.")
    p.add_argument("--config", help="TOML file with a [pool] table")
    p.add_argument("--gateway", action="append", dest="gateways", metavar="URL",
                   help="region gateway URL; repeat to add alternates, in order of preference")
    p.add_argument("--broker", help="broker URL")
    p.add_argument("--token", help="the region's pool token")
    p.add_argument("--name", help="pool name")
    p.add_argument("--engine", choices=("transformers", "sglang"))
    p.add_argument("--engine-url", action="append", metavar="URL",
                   help="SGLang: attach to this server instead of launching one (once per --model-id)")
    p.add_argument("--model", action="append", metavar="PATH",
                   help="model directory (config, tokenizer) the engine starts from; once, or once per --model-id")
    p.add_argument("--model-id", action="append", metavar="ID",
                   help="a policy to serve (repeatable; default: the one model the gateway serves)")
    p.add_argument("--role", action="append", metavar="ROLE=MODEL_ID", help="which policy plays a workflow role")
    p.add_argument("--dir", help="root of the synced weights (one directory per model_id below it)")
    p.add_argument("--trusted-key", action="append", dest="trusted_keys", metavar="PEM",
                   help="trainer public key whose signatures are accepted (repeatable)")
    p.add_argument("--gpus", type=int)
    p.add_argument("--tier", help="label of this pool's hardware tier")
    p.add_argument("--region", help="region name (default: the gateway's)")
    p.add_argument("--device", help="transformers engine device (cpu, cuda, cuda:1)")
    p.add_argument("--threads", type=int, help="torch CPU threads (0: torch's default)")
    p.add_argument("--listen", help="HOST:PORT of the pool's status and /metrics server (default 127.0.0.1:0)")
    p.add_argument("--workflow", help="workflow name (math, solver_verifier, or module:SPEC)")
    p.add_argument("--workflow-options", metavar="JSON", help="the workflow's options as a JSON object")
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--temperature", type=float)
    p.add_argument("--top-p", type=float)
    p.add_argument("--top-k", type=int)
    p.add_argument("--ignore-eos", action="store_true", default=None)
    p.add_argument("--max-staleness", type=int,
                   help="stop leasing while more than this many versions behind the newest known version")
    p.add_argument("--lease-batch", type=int, help="most tasks per lease request")
    p.add_argument("--episodes", type=int, dest="max_episodes", help="episodes run at once")
    p.add_argument("--no-hot-swap", action="store_false", dest="hot_swap", default=None,
                   help="reload every version from the synced directory instead of swapping in place")
    p.add_argument("--full-every", type=int, help="take a full snapshot after this many deltas in a row")
    p.add_argument("--heartbeat", type=float, dest="heartbeat_s", help="seconds between heartbeats")
    p.add_argument("--stall-timeout", type=float, dest="stall_timeout_s", help="seconds of silence before failover")
    p.set_defaults(run=run)


FLAT = ("gateways", "broker", "token", "name", "engine", "dir", "trusted_keys", "gpus", "tier", "region", "device",
        "threads", "listen", "workflow", "max_staleness", "lease_batch", "max_episodes", "hot_swap", "full_every",
        "heartbeat_s", "stall_timeout_s")
SAMPLING = ("max_new_tokens", "temperature", "top_p", "top_k", "ignore_eos")


def overrides(args: argparse.Namespace) -> dict:
    """The config overrides the flags make (None: not given, so the file or the default stands)."""
    import json

    out = {name: getattr(args, name) for name in FLAT}
    out.update({f"sampling.{name}": getattr(args, name) for name in SAMPLING})
    if args.workflow_options is not None:
        out["workflow_options"] = json.loads(args.workflow_options)
    if args.role:
        out["roles"] = dict(_pair(r) for r in args.role)
    ids, paths, urls = args.model_id or [], args.model or [], args.engine_url or []
    if ids or paths or urls:
        count = max(len(ids), 1)
        for flag, values in (("--model", paths), ("--engine-url", urls)):
            if len(values) not in (0, 1, count):
                raise ValueError(f"give {flag} once, or once per --model-id ({count})")
        out["models"] = [{"model_id": ids[i] if ids else "",
                          "model_path": paths[i if len(paths) > 1 else 0] if paths else "",
                          "engine_url": urls[i if len(urls) > 1 else 0] if urls else ""} for i in range(count)]
    return out


def _pair(text: str) -> tuple[str, str]:
    role, sep, model_id = text.partition("=")
    if not sep or not role or not model_id:
        raise ValueError(f"--role wants ROLE=MODEL_ID, got {text!r}")
    return role, model_id


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import signal

    from deltamesh.config import ConfigError, load_config
    from deltamesh.mesh.engines.base import EngineError
    from deltamesh.mesh.pool.config import PoolConfig
    from deltamesh.mesh.pool.pool import PoolError, RolloutPool
    from deltamesh.mesh.workflows import WorkflowError

    log = logging.getLogger(__name__)
    try:
        config = load_config(PoolConfig, args.config, section="pool", overrides=overrides(args))
    except (ConfigError, ValueError) as e:
        log.error("%s", e)
        return 2

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await RolloutPool(config).run(stop)
        except (PoolError, WorkflowError) as e:
            log.error("%s", e)
            return 1 if stop.is_set() else 2
        except (EngineError, OSError) as e:  # the engine could not start (model directory, SGLang server)
            log.error("pool %s: %s", config.name, e)
            return 1
        return 0

    return asyncio.run(main())
