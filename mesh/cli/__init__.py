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
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from deltamesh import __version__
from deltamesh.logs import setup_logging

if TYPE_CHECKING:
    from deltamesh.signals import Stop

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
    "bench",
    "broker",
    "train",
    "console",
    "eval",
)


def build_parser(*, lazy: bool = False) -> argparse.ArgumentParser:
    """The whole command line. `lazy`: each command's setting flags are added only when that command
    parses (`CommandParser`), so that running one command does not pay for every other's flags."""
    parser = CommandParser(
        prog="deltamesh",
        description="Multi-region weight distribution and rollout mesh for RL of LLMs.",
    )
    parser.add_argument("--version", action="version", version=f"deltamesh {__version__}")
    add_global_flags(parser, None)
    sub = parser.add_subparsers(title="commands", metavar="COMMAND")
    pool_sub = command_group(sub, "pool", help="run or sync a rollout pool")
    for name in COMMAND_MODULES:
        importlib.import_module(f"{__name__}.{name}").register(sub, pool_sub)
    for command in _parsers(parser)[1:]:  # before or after the command: `deltamesh gateway --log-format json`
        add_global_flags(command, argparse.SUPPRESS)
    if not lazy:
        for command in _parsers(parser):
            command.add_deferred()
    return parser


def add_global_flags(parser: argparse.ArgumentParser, default: Any) -> None:
    """The flags every command takes. A command's parser gets them with `default` SUPPRESS, so that one
    given before the command is not reset by its absence after it."""
    from deltamesh.logs import LOG_FORMATS

    group = parser.add_argument_group("logging (before or after the command)")
    group.add_argument("--log-level", default=default, help="DEBUG, INFO (default), WARNING, ERROR")
    group.add_argument("--log-format", choices=LOG_FORMATS, default=default,
                       help="text (default) or json: one JSON object a line ($DELTAMESH_LOG_FORMAT)")


class CommandParser(argparse.ArgumentParser):
    """An ArgumentParser that adds some of its arguments only when it first parses: deriving a
    command's flags from its config reads that config's source (for the help texts), which costs
    more than all else `deltamesh gateway` does before it serves, and only the command run needs it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.deferred: list[Callable[[], None]] = []

    def add_deferred(self) -> None:
        while self.deferred:
            self.deferred.pop(0)()

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        self.add_deferred()
        return super().parse_known_args(args, namespace)


def _parsers(parser: argparse.ArgumentParser) -> list[CommandParser]:
    """`parser` and every subcommand's parser under it."""
    found = [parser] if isinstance(parser, CommandParser) else []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                found += _parsers(sub)
    return found


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
    if isinstance(parser, CommandParser):
        parser.deferred.append(functools.partial(add_config_flags, parser, cls, section=section))
    else:
        add_config_flags(parser, cls, section=section)
    parser.set_defaults(run=_reporting_failures(run))
    return parser


def _reporting_failures(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """`run`, with a `CommandFailed` raised inside it reported (`failed`) and made its exit code, and so
    is an expected failure that no handler of the command caught (`exits.expected_exit`)."""
    @functools.wraps(run)
    def reporting(args: argparse.Namespace) -> int:
        from deltamesh.mesh.cli.exits import describe, expected_exit

        try:
            return run(args)
        except CommandFailed as e:
            return failed(e.reason, e.code)
        except Exception as e:  # an expected failure (docs/CLI.md) is one line; anything else keeps its traceback
            code = expected_exit(e)
            if code is None:
                raise
            return failed(describe(e), code)

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


def stop_on_signals(what: str = "deltamesh") -> Stop:
    """An event that SIGINT or SIGTERM sets, for a long-running command to stop cleanly on (call it
    inside the running event loop); after the clean stop the command returns its `exit_code`, 130 or
    143 (`deltamesh.signals`). `what` names the process in the "stopping" line."""
    from deltamesh.signals import stop_on_signals as stopping

    return stopping(what)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(lazy=True)
    args = parser.parse_args(argv)
    run = getattr(args, "run", None)
    if run is None:
        return usage(parser)
    if args.log_format:  # the processes a command starts (the demo's, an autoscaler's pools) log alike
        os.environ["DELTAMESH_LOG_FORMAT"] = args.log_format
    setup_logging(args.log_level, log_format=args.log_format)
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
