"""`deltamesh train`: run a trainer that turns the broker's batches into versions on the origin gateway.

Settings come from `--config FILE`: its `[trainer]` table (loss, optimizer, checkpoints; see
trainer/config.py) and its `[train]` table (broker, gateway, model, key, batch size, publishing; see
trainer/loop_config.py); flags given on the command line override them. Start it with `torchrun
--no-python --nproc-per-node N deltamesh train ...` to shard the model over N ranks with FSDP.
"""

from __future__ import annotations

import argparse
import os


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "train", help="run a trainer: batches from the broker in, new weight versions out",
        description="Long-poll batches from the broker, take an RL step on fp32 master weights, publish each "
                    "new bf16 version to the origin gateway (a delta on the previous one) and report it to the "
                    "broker. Checkpoints let a restarted trainer continue its version sequence.")
    p.add_argument("--config", help="TOML file with [trainer] and [train] tables")
    p.add_argument("--broker", help="broker URL")
    p.add_argument("--gateway", help="origin gateway URL")
    p.add_argument("--model-id", help="the model_id of this policy's weight stream and batches")
    p.add_argument("--model", help="initial model: a Hugging Face model directory (bf16 or fp32)")
    p.add_argument("--key", help="the trainer's Ed25519 private key (PEM)")
    p.add_argument("--checkpoint-dir", help="directory of the trainer's checkpoints")
    p.add_argument("--checkpoint-every", type=int, help="checkpoint every N versions")
    p.add_argument("--batch-size", type=int, help="samples per batch (whole groups)")
    p.add_argument("--max-steps", type=int, help="stop after this many optimizer steps in all (restarts included)")
    p.add_argument("--lr", type=float, help="learning rate")
    p.add_argument("--full-every", type=int, help="also publish a full snapshot every N versions")
    p.add_argument("--poll", type=float, dest="poll_s", help="seconds one batch long-poll may wait")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"))
    p.add_argument("--metrics-file", help="append one JSON line per step here")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import logging

    from deltamesh.config import ConfigError, load_config
    from deltamesh.logs import setup_logging
    from deltamesh.trainer.config import TrainerConfig
    from deltamesh.trainer.loop import run_training
    from deltamesh.trainer.loop_config import TrainLoopConfig

    log = logging.getLogger(__name__)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        setup_logging(args.log_level, process_name=f"rank{os.environ.get('RANK', '?')}")
    trainer_overrides = {"model_id": args.model_id, "checkpoint.dir": args.checkpoint_dir,
                         "checkpoint.every": args.checkpoint_every, "optim.lr": args.lr}
    loop_overrides = {name: getattr(args, name) for name in (
        "broker", "gateway", "model", "key", "batch_size", "max_steps", "full_every", "poll_s", "device",
        "metrics_file")}
    try:
        cfg = load_config(TrainerConfig, args.config, section="trainer", overrides=trainer_overrides)
        loop_cfg = load_config(TrainLoopConfig, args.config, section="train", overrides=loop_overrides)
    except ConfigError as e:
        log.error("%s", e)
        return 2
    return run_training(cfg, loop_cfg)
