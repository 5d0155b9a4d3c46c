"""The `deltamesh` command line: one subcommand per module of this package.

Each module named in COMMAND_MODULES exposes `register(commands, pool_commands)`, which adds its
parsers to the top-level subcommands or to those of `deltamesh pool`, each with
`set_defaults(run=callable)`. The callable takes the parsed namespace and returns an exit code.
A command's setting flags are derived from its config dataclass (`deltamesh.config_flags`), so
`register` imports that config module (a light one); everything heavy is imported inside the
callable, so `deltamesh --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from deltamesh import __version__
from deltamesh.logs import setup_logging

# One line per command module in this package; add yours here.
COMMAND_MODULES: tuple[str, ...] = (
    "version",
    "demo",
    "keys",
    "certs",
    "tokens",
    "gateway",
    "publish",
    "pool_sync",
    "pool_run",
    "pools",
    "links",
    "broker",
    "train",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="deltamesh",
        description="Multi-region weight distribution and rollout mesh for RL of LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"deltamesh {__version__}")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING, ERROR")
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    pool = sub.add_parser("pool", help="run or sync a rollout pool")
    pool_sub = pool.add_subparsers(title="pool commands", metavar="POOL_COMMAND")
    pool.set_defaults(run=lambda args: _missing(pool))
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub, pool_sub)
    return parser


def _missing(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "run", None)
    if run is None:
        return _missing(parser)
    setup_logging(args.log_level)
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
