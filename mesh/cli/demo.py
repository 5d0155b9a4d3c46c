"""`deltamesh demo`: the whole mesh on this machine, learning a task by RL while you watch.

With no flags: an origin gateway and two remote regions (one relaying through the other, over links
with a bandwidth cap and added latency), three rollout pools across the regions, the dataflow broker
and a trainer, each a real process; the tiny model learns the digit-sum task in about a minute on
two cores. A live view shows the trainer, the pools and the links; at the end every pool is checked to
hold the trainer's final weights bit for bit, and a report (JSON and a chart) is written. Settings
may come from the `[demo]` table of `--config` (see mesh/demo/config.py); flags override it.
`--codec-tour` instead runs the codec tour on real SmolLM2 weights (mesh/demo/codec_tour.py).
"""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser(
        "demo", help="run the whole mesh on this machine: gateways, pools, broker and trainer",
        description="Run a three-region mesh (origin gateway, a relay, a relay of the relay), rollout pools, "
                    "the broker and a trainer as processes on this machine, show them at work, check every "
                    "pool ends bit-exact on the trainer's final version, and write a report. Ctrl-C stops "
                    "everything cleanly.")
    p.add_argument("--steps", type=int, help="trainer steps (default 60)")
    p.add_argument("--model", choices=("tiny", "smollm2"),
                   help="tiny random-init model (default) or the real pretrained SmolLM2-135M-Instruct")
    p.add_argument("--workflow", choices=("math", "solver-verifier", "solver_verifier"),
                   help="math: one policy (default); solver-verifier: two policies, two trainers")
    p.add_argument("--seed", type=int, help="seed of the trainer, the pools' sampling and the task set")
    p.add_argument("--lr", type=float, help="learning rate (default: the model's recipe; codec tour: 5e-6)")
    p.add_argument("--pools", type=int, help="run only the topology's first N pools")
    p.add_argument("--full-every", type=int, help="also publish a full snapshot every N versions (default 10)")
    p.add_argument("--topology", metavar="FILE", help="TOML file with a [topology] table (see mesh/demo/topology.py)")
    p.add_argument("--config", metavar="FILE", help="TOML file with a [demo] table")
    p.add_argument("--run-dir", help="where logs, stores and the report go (default runs/demo-<timestamp>)")
    p.add_argument("--plain", action="store_true", help="log progress lines instead of the live view")
    p.add_argument("--codec-tour", action="store_true", help="run the codec tour on real SmolLM2 weights instead")
    p.add_argument("--batch", type=int, default=2, help="codec tour: sequences in the training batch (default 2)")
    p.add_argument("--seq-len", type=int, default=128, help="codec tour: tokens per sequence (default 128)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import asyncio
    import logging
    import sys

    from rich.console import Console

    from deltamesh.config import ConfigError, load_config, to_dict
    from deltamesh.mesh.demo.config import DemoConfig
    from deltamesh.mesh.demo.topology import load_topology

    console = Console()
    if args.codec_tour:
        from deltamesh.mesh.demo.codec_tour import codec_tour

        facts = codec_tour(console, lr=args.lr if args.lr is not None else 5e-6, batch=args.batch,
                           seq_len=args.seq_len)
        return 0 if facts["exact"] and facts["tamper_refused"] else 1

    from deltamesh.mesh.demo.run import run_demo
    from deltamesh.mesh.demo.summary import print_summary

    workflow = args.workflow.replace("-", "_") if args.workflow else None
    overrides = {"steps": args.steps, "model": args.model, "workflow": workflow, "seed": args.seed, "lr": args.lr,
                 "pools": args.pools, "full_every": args.full_every, "run_dir": args.run_dir}
    try:
        if args.topology:
            overrides["topology"] = to_dict(load_topology(args.topology))
        config = load_config(DemoConfig, args.config, section="demo", overrides=overrides)
    except (ConfigError, ValueError) as e:
        logging.getLogger(__name__).error("%s", e)
        return 2
    live = console.is_terminal and not args.plain and sys.stdout.isatty()
    result = asyncio.run(run_demo(config, console=console, live=live))
    print_summary(console, result)
    return result.exit_code

