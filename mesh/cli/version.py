"""`deltamesh version`: print the version and where each component is installed from."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("version", help="show the version and component locations")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    import importlib

    import deltamesh

    print(f"deltamesh {deltamesh.__version__}")
    for part in ("delta", "gateway", "trainer", "mesh"):
        module = importlib.import_module(f"deltamesh.{part}")
        print(f"  deltamesh.{part}: {module.__path__[0]}")
    return 0
