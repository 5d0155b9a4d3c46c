"""`deltamesh demo`: the whole mesh on this machine, learning a task by RL while you watch.

With no flags: an origin gateway and two remote regions (one relaying through the other, over links
with a bandwidth cap and added latency), three rollout pools across the regions, the dataflow broker
and a trainer, each a real process; the tiny model learns the digit-sum task in about a minute on
two cores. A live view shows the trainer, the pools and the links; at the end every pool is checked to
hold the trainer's final weights bit for bit, and a report (JSON and a chart) is written. Settings
may come from the `[demo]` table of `--config` (see mesh/demo/config.py); the flags, derived from
that dataclass, override it.
`--codec-tour` instead runs the codec tour on real SmolLM2 weights (mesh/demo/codec_tour.py).
"""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import config_command
    from deltamesh.mesh.demo.config import DemoConfig

    p = config_command(
        commands, "demo", DemoConfig, run, section="demo",
        help="run the whole mesh on this machine: gateways, pools, broker and trainer",
        description="Run a three-region mesh (origin gateway, a relay, a relay of the relay), rollout pools, "
                    "the broker and a trainer as processes on this machine, show them at work, check every "
                    "pool ends bit-exact on the trainer's final version, and write a report. Ctrl-C stops "
                    "everything cleanly.")
    p.add_argument("--topology", metavar="FILE", help="TOML file with a [topology] table (see mesh/demo/topology.py)")
    p.add_argument("--plain", action="store_true", help="log progress lines instead of the live view")
    tour = p.add_argument_group("codec tour")
    tour.add_argument("--codec-tour", action="store_true", help="run the codec tour on real SmolLM2 weights instead "
                                                                "(--lr sets its learning rate, default 5e-6)")
    tour.add_argument("--batch", type=int, default=2, help="sequences in the training batch (default 2)")
    tour.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default 128)")


def overrides(args: argparse.Namespace) -> dict:
    """The config overrides the flags make, --topology's file among them."""
    from deltamesh.config import to_dict
    from deltamesh.config_flags import config_overrides
    from deltamesh.mesh.demo.config import DemoConfig
    from deltamesh.mesh.demo.topology import load_topology

    out = config_overrides(args, DemoConfig)
    if args.topology:
        out["topology"] = to_dict(load_topology(args.topology))
    return out


def run(args: argparse.Namespace) -> int:
    import asyncio
    import sys

    from rich.console import Console

    from deltamesh.config_flags import config_overrides
    from deltamesh.mesh.cli import command_config
    from deltamesh.mesh.demo.config import DemoConfig

    console = Console()
    if args.codec_tour:
        from deltamesh.mesh.demo.codec_tour import codec_tour

        lr = config_overrides(args, DemoConfig).get("lr", 5e-6)
        facts = codec_tour(console, lr=lr, batch=args.batch, seq_len=args.seq_len)
        return 0 if facts["exact"] and facts["tamper_refused"] else 1

    from deltamesh.mesh.demo.run import run_demo
    from deltamesh.mesh.demo.summary import print_summary

    config = command_config(args, DemoConfig, "demo", overrides=overrides)
    live = console.is_terminal and not args.plain and sys.stdout.isatty()
    result = asyncio.run(run_demo(config, console=console, live=live))
    print_summary(console, result)
    return result.exit_code
