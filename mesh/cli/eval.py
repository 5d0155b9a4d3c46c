"""`deltamesh eval`: score a policy's published versions on a held-out set while it trains.

Settings come from the `[eval]` table of `--config FILE` (mesh/eval/config.py, docs/CONFIG.md); the
flags, derived from that dataclass, override it. The evaluator follows its gateway like a pool (with
a pool token of its own name), scores version 0, every k-th version and any an admin asks for
(`POST /v1/evals`), and serves the results at `GET /v1/evals` (docs/API.md).
"""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import config_command
    from deltamesh.mesh.eval.config import EvalConfig

    config_command(
        commands, "eval", EvalConfig, run, section="eval",
        help="score a policy's versions on a held-out set (avg@n) while it trains",
        description="Follow a gateway like a pool, and score version 0, every k-th version (--every) and any "
                    "version an admin asks for on a held-out set, n samples per problem, through a real engine; "
                    "store each result with the version and the weights hash the engine proved it served, and "
                    "serve them at /v1/evals and as Prometheus metrics. The trainer never waits for it.")


def run(args: argparse.Namespace) -> int:
    import asyncio

    from deltamesh.gateway.fetch.errors import CredentialsError
    from deltamesh.http import HttpError
    from deltamesh.mesh.cli import command_config, failed, stop_on_signals
    from deltamesh.mesh.cli.exits import describe, exit_code
    from deltamesh.mesh.engines.base import EngineError
    from deltamesh.mesh.eval.config import EvalConfig
    from deltamesh.mesh.eval.service import EvalError, run_evaluator
    from deltamesh.mesh.workflows import WorkflowError

    config = command_config(args, EvalConfig, "eval")

    async def main() -> int:
        stop = stop_on_signals(f"evaluator {config.name}")
        try:
            await run_evaluator(config, stop)
        except (CredentialsError, HttpError) as e:
            return failed(describe(e), exit_code(e, 1))
        except (EvalError, WorkflowError) as e:
            return failed(e, 2)
        except (EngineError, OSError) as e:
            return failed(f"evaluator {config.name}: {e}", exit_code(e, 1))
        return stop.exit_code

    return asyncio.run(main())
