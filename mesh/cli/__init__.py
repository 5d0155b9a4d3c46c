"""The `deltamesh` command line: one subcommand per module of this package.

Each module named in COMMAND_MODULES exposes `register(commands, pool_commands)`, which adds its
parsers to the top-level subcommands or to those of `deltamesh pool`, each with
`set_defaults(run=callable)`. The callable takes the parsed namespace and returns an exit code.
A command's setting flags are derived from its config dataclass (`deltamesh.config_flags`), so
`register` imports that config module (a light one); everything heavy is imported inside the
callable, so `deltamesh --help` stays fast.

The helpers below are the one way commands do what they all do: `config_command` adds a command
whose settings are a config dataclass, `command_config` loads them (or stops the command, raising
`CommandFailed`, which the command then reports), `command_group` adds a command that only holds subcommands,
`failed` reports why a command stops and `stop_on_signals` gives a long-running command its clean
stop.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import sys
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from deltamesh import __version__
from deltamesh.logs import setup_logging

if TYPE_CHECKING:
    import asyncio

T = TypeVar("T")

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
    pool_sub = command_group(sub, "pool", help="run or sync a rollout pool")
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub, pool_sub)
    return parser


def usage(parser: argparse.ArgumentParser) -> int:
    """Show `parser`'s help on stderr; exit code 2, as for any other usage error."""
    parser.print_help(sys.stderr)
    return 2


def command_group(commands: argparse._SubParsersAction, name: str, **options: Any) -> argparse._SubParsersAction:
    """Add command `name` that only holds subcommands (`deltamesh keys generate`) and return where they
    go; called alone it shows its help."""
    group = commands.add_parser(name, **options)
    group.set_defaults(run=lambda args: usage(group))
    return group.add_subparsers(title=f"{name} commands", metavar=f"{name.upper()}_COMMAND")


def config_command(commands: argparse._SubParsersAction, name: str, cls: type, run: Callable[[argparse.Namespace], int],
                   *, section: str | None = None, description: str = "", **options: Any) -> argparse.ArgumentParser:
    """Add command `name`, run by `run`, whose settings are config dataclass `cls`: a flag for each
    and, for a command that reads the table `section` of a config file, `--config FILE` (which its
    description then names)."""
    from deltamesh.config_flags import add_config_flags

    if section is not None:
        description = f"{description} Flags override the [{section}] table of --config (docs/CONFIG.md).".lstrip()
    parser = commands.add_parser(name, description=description or None, **options)
    if section is not None:
        parser.add_argument("--config", metavar="FILE", help=f"TOML file with a [{section}] table")
    add_config_flags(parser, cls, section=section)
    parser.set_defaults(run=_reporting_failures(run))
    return parser


def _reporting_failures(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`run`, with a `CommandFailed` raised inside it reported (`failed`) and made its exit code."""
    @functools.wraps(run)
    def reporting(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except CommandFailed as e:
            return failed(e.reason, e.code)

    return reporting


class CommandFailed(Exception):
    """Stops a command added by `config_command` from inside a helper: the command reports `reason` as
    one line (`failed`) and exits with `code`."""

    def __init__(self, reason: object, code: int = 2) -> None:
        super().__init__(str(reason))
        self.reason = reason
        self.code = code


def command_config(args: argparse.Namespace, cls: type[T], section: str | None = None,
                   overrides: Callable[[argparse.Namespace], dict] | None = None) -> T:
    """The settings of a command added by `config_command`: the table `section` of its --config file
    (if it reads one) under what the flags override (`overrides(args)` where the command adds
    overrides of its own). When they do not load the command stops with exit code 2 (`CommandFailed`),
    the reason logged: a bad setting is the user's to fix and a traceback would only hide the reason."""
    from deltamesh.config import load_config
    from deltamesh.config_flags import config_overrides

    try:
        given = config_overrides(args, cls) if overrides is None else overrides(args)
        return load_config(cls, args.config if section is not None else None, section=section, overrides=given)
    except ValueError as e:  # a ConfigError, or flags that `overrides` refuses
        raise CommandFailed(e) from None


def failed(reason: object, code: int = 2) -> int:
    """Log why a command stops, as one line, and return its exit code (2: the user's input is wrong)."""
    logging.getLogger(__name__).error("%s", reason)
    return code


def stop_on_signals() -> asyncio.Event:
    """An event that SIGINT or SIGTERM sets, for a long-running command to stop cleanly on (call it
    inside the running event loop)."""
    import asyncio
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    return stop


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "run", None)
    if run is None:
        return usage(parser)
    setup_logging(args.log_level)
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
