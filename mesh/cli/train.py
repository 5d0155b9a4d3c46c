"""`deltamesh train`: run a trainer that turns the broker's batches into versions on the origin gateway.

Settings come from the `[trainer]` table of `--config FILE` (the compute core's model_id, loss,
optimizer and checkpoints beside the loop's broker, gateway, model, key, batch size and publishing;
see trainer/loop_config.py and docs/CONFIG.md); the flags, derived from that dataclass, override it.
Start it with `torchrun --no-python --nproc-per-node N deltamesh train ...` to shard the model over N
ranks with FSDP.
"""

from __future__ import annotations

import argparse
import os


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import config_command
    from deltamesh.trainer.loop_config import TrainLoopConfig

    config_command(
        commands, "train", TrainLoopConfig, run, section="trainer",
        help="run a trainer: batches from the broker in, new weight versions out",
        description="Long-poll batches from the broker, take an RL step on fp32 master weights, publish each "
                    "new bf16 version to the origin gateway (a delta on the previous one) and report it to the "
                    "broker. Checkpoints let a restarted trainer continue its version sequence.")


def run(args: argparse.Namespace) -> int:
    from deltamesh.logs import setup_logging
    from deltamesh.mesh.cli import command_config
    from deltamesh.trainer.loop import run_training
    from deltamesh.trainer.loop_config import TrainLoopConfig

    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        setup_logging(args.log_level, process_name=f"rank{os.environ.get('RANK', '?')}")
    cfg = command_config(args, TrainLoopConfig, "trainer")
    return run_training(cfg)
