"""Command line of the WAN emulator (root, plus what setup.sh installs): `up` a network from a
topology file (left running, or held until Ctrl-C with `--hold`), `verify` its links as a table
or JSON, `down` one network, `cleanup` every namespace with a name prefix (what a crashed or
SIGKILLed run left), and `capacity`, which finds the rates one link of a given RTT sustains here.

    python benchmarks/wan/cli.py up --topology benchmarks/wan/topologies/fanout.toml --prefix dmwan
    python benchmarks/wan/cli.py verify --prefix dmwan [--json] [--rtt-only] [--seconds S]
    python benchmarks/wan/cli.py down --prefix dmwan
    python benchmarks/wan/cli.py cleanup --prefix dm
    python benchmarks/wan/cli.py capacity --rtt-ms 300 --mbit 400,800,1200 [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="wan", description="Emulate a WAN in network namespaces.")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build a network from a topology file")
    up.add_argument("--topology", type=Path, required=True)
    up.add_argument("--prefix", required=True, help="namespace names start with PREFIX-")
    up.add_argument("--hold", action="store_true", help="stay in the foreground; tear down on Ctrl-C")
    up.add_argument("--verify", action="store_true", help="verify every link once it is up")
    _add_verify_options(up)
    verify = sub.add_parser("verify", help="measure every link of a running network")
    verify.add_argument("--prefix", required=True)
    _add_verify_options(verify)
    capacity = sub.add_parser("capacity", help="measure which rates one link of an RTT sustains here")
    capacity.add_argument("--rtt-ms", type=float, default=300.0)
    capacity.add_argument("--mbit", default="100,400,800", help="comma-separated rates to try")
    _add_verify_options(capacity)
    for name, text in (("down", "tear down one network"), ("cleanup", "remove leftovers by name prefix")):
        sub.add_parser(name, help=text).add_argument("--prefix", required=True)
    return parser


def _add_verify_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--seconds", type=float, default=None, help="bulk transfer length per link")
    parser.add_argument("--streams", type=int, default=4, help="parallel TCP streams per link")
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--rtt-only", action="store_true", help="measure RTT only (no bulk transfer)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a table")


def main(argv: list[str] | None = None) -> int:
    # Run as a script, this file's package is not importable until benchmarks/ is on the path.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from deltamesh.logs import setup_logging

    args = build_parser().parse_args(argv)
    setup_logging(args.log_level)
    from wan import WanError

    try:
        return COMMANDS[args.command](args)
    except WanError as exc:
        logging.getLogger("wan").error("%s", exc)
        return 1


def cmd_up(args: argparse.Namespace) -> int:
    from wan import Wan, build, load_topology

    topology = load_topology(args.topology)
    with Wan(args.prefix, unique=False) as wan:
        build(wan, topology)
        code = _report(wan, args) if args.verify else 0
        if args.hold:
            wan.save_state()
            print(f"network {wan.prefix} is up; Ctrl-C tears it down", flush=True)
            try:
                signal.pause()  # SIGINT/SIGTERM raise out of here (see Wan.__enter__)
            except KeyboardInterrupt:
                pass
            return code
        path = wan.detach()
        print(f"network {wan.prefix} is up ({len(wan.hosts)} hosts, {len(wan.links)} links); state in {path}")
        return code


def cmd_verify(args: argparse.Namespace) -> int:
    from wan import Wan

    with Wan.attach(args.prefix) as wan:
        return _report(wan, args)


def _report(wan, args: argparse.Namespace) -> int:
    from wan import verify_all

    checks = verify_all(wan, **_verify_options(args))
    return _print_checks(wan.prefix, checks, args.json)


def cmd_capacity(args: argparse.Namespace) -> int:
    from wan import Wan, verify_link

    checks = []
    for mbit in (float(text) for text in args.mbit.split(",")):
        with Wan("wancap") as wan:
            a, b = wan.host("sender"), wan.host("receiver")
            wan.link(a, b, mbit=mbit, rtt_ms=args.rtt_ms)
            checks.append(verify_link(a, b, **_verify_options(args)))
    return _print_checks("capacity", checks, args.json)


def _verify_options(args: argparse.Namespace) -> dict:
    return {"seconds": args.seconds, "streams": args.streams, "tolerance": args.tolerance,
            "measure_rate": not args.rtt_only}


def _print_checks(name: str, checks: list, as_json: bool) -> int:
    from wan import format_table

    if as_json:
        print(json.dumps({"prefix": name, "links": [c.as_dict() for c in checks]}))
    else:
        print(format_table(checks))
    return 0 if all(c.ok for c in checks) else 1


def cmd_down(args: argparse.Namespace) -> int:
    return _remove(f"{args.prefix}-", [args.prefix])


def cmd_cleanup(args: argparse.Namespace) -> int:
    from wan.emulator import STATE_DIR

    # Every state file and log folder whose network name starts with the prefix.
    runs = {path.name.removesuffix(".json") for path in STATE_DIR.glob(f"{args.prefix}*")}
    return _remove(args.prefix, sorted(runs))


def _remove(namespace_prefix: str, runs: list[str]) -> int:
    from wan import purge
    from wan.emulator import remove_state

    names = purge(namespace_prefix)
    for run in runs:
        remove_state(run)
    print(f"removed {len(names)} namespace(s)" + (f": {' '.join(names)}" if names else ""))
    return 0


COMMANDS = {"up": cmd_up, "verify": cmd_verify, "down": cmd_down, "cleanup": cmd_cleanup,
            "capacity": cmd_capacity}

if __name__ == "__main__":
    sys.exit(main())
