"""`deltamesh pool run`: a rollout pool (engines kept at the gateway's head, and a rollout worker)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import config_command
    from deltamesh.mesh.pool.config import PoolConfig

    p = config_command(
        pool_commands, "run", PoolConfig, run, section="pool",
        help="run a rollout pool: weight sync, engine and rollout worker",
        description="Start a rollout pool: its engines follow the region's gateway (hot swap in place where the "
                    "engine can), and its worker leases tasks from the broker, runs the workflow and submits "
                    "trajectories. A pool of several policies is described in the config file "
                    "([[pool.models]]) or with --model-id repeated.")
    # A shorthand for [[pool.models]], which as a list of tables has no derived flags.
    policies = p.add_argument_group("policies (shorthand for [[pool.models]])")
    policies.add_argument("--model", action="append", metavar="PATH",
                          help="model directory (config, tokenizer) the engine starts from; once, or once per "
                               "--model-id")
    policies.add_argument("--model-id", action="append", metavar="ID",
                          help="a policy to serve (repeatable; default: the one model the gateway serves)")
    policies.add_argument("--engine-url", action="append", metavar="URL",
                          help="SGLang: attach to this server instead of launching one (once per --model-id)")


def overrides(args: argparse.Namespace) -> dict:
    """The config overrides the flags make (flags not given leave the file or the default standing)."""
    from deltamesh.config_flags import config_overrides
    from deltamesh.mesh.pool.config import PoolConfig

    out = config_overrides(args, PoolConfig)
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


def run(args: argparse.Namespace) -> int:
    import asyncio

    from deltamesh.gateway.fetch.errors import CredentialsError
    from deltamesh.http import HttpError
    from deltamesh.mesh.cli import command_config, failed, stop_on_signals
    from deltamesh.mesh.cli.exits import describe, exit_code
    from deltamesh.mesh.cli.progress import transfer_progress
    from deltamesh.mesh.engines.base import EngineError
    from deltamesh.mesh.pool.config import PoolConfig
    from deltamesh.mesh.pool.pool import PoolError, RolloutPool
    from deltamesh.mesh.workflows import WorkflowError

    config = command_config(args, PoolConfig, "pool", overrides=overrides)

    async def main() -> int:
        stop = stop_on_signals(f"pool {config.name}")
        try:
            # Each policy's weight stream shows its transfers: a bar on a terminal, else a line every few seconds.
            await RolloutPool(config, on_weights=progress.watch).run(stop)  # stopped: the apply ends, it deregisters
        except (CredentialsError, HttpError) as e:  # the gateway refused the token (4, before any download)
            return failed(describe(e), exit_code(e, 1))
        except (PoolError, WorkflowError) as e:
            # A weight stream that ended (PoolError from its error) keeps that error's code: refused
            # credentials are 4 whether found at start-up or later (docs/CLI.md), as for `pool sync`.
            return failed(e, exit_code(e, 1 if stop.is_set() else 2))
        except (EngineError, OSError) as e:  # the engine could not start (model directory, SGLang server)
            return failed(f"pool {config.name}: {e}", exit_code(e, 1))  # a port in use: 5, a full disk: 6
        return stop.exit_code  # 130/143 after a signal

    with transfer_progress() as progress:
        return asyncio.run(main())
