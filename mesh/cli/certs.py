"""`deltamesh certs ca|issue`: a small certificate authority for a mesh's TLS (see docs/SECURITY.md).

`ca --out DIR` writes DIR/ca.pem and DIR/ca.key; `issue --ca DIR --name ROLE/NAME --host H... --out
DIR` writes a certificate for servers (the hosts) and clients (the name: a server that requires client
certificates takes ROLE/NAME as the caller's identity). Keys are written with mode 0600; an existing
CA is never overwritten without --force.
"""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("certs", help="make a CA and TLS certificates for gateways, brokers, pools, trainers")
    sub = p.add_subparsers(title="certs commands", metavar="CERTS_COMMAND")
    ca = sub.add_parser("ca", help="create a CA: DIR/ca.pem and DIR/ca.key")
    ca.add_argument("--out", required=True, metavar="DIR", help="folder for ca.pem and ca.key")
    ca.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    ca.add_argument("--force", action="store_true", help="overwrite an existing CA")
    ca.set_defaults(run=run_ca)
    issue = sub.add_parser("issue", help="issue a server/client certificate signed by the CA")
    issue.add_argument("--ca", required=True, metavar="DIR", help="folder holding ca.pem and ca.key")
    issue.add_argument("--name", required=True, metavar="ROLE/NAME",
                       help="the holder: gateway/REGION, broker/NAME, pool/NAME, trainer/MODEL, admin/NAME")
    issue.add_argument("--host", action="append", default=[], metavar="HOST",
                       help="a DNS name or IP address the holder serves on (once per host)")
    issue.add_argument("--out", required=True, metavar="DIR", help="folder for NAME.pem and NAME.key")
    issue.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    issue.set_defaults(run=run_issue)
    p.set_defaults(run=lambda args: _usage(p))


def _usage(parser: argparse.ArgumentParser) -> int:
    import sys

    parser.print_help(sys.stderr)
    return 2


def run_ca(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from deltamesh.certs import make_ca

    out = Path(args.out)
    if not args.force and ((out / "ca.pem").exists() or (out / "ca.key").exists()):
        logging.getLogger(__name__).error("%s already holds a CA; pass --force to replace it", out)
        return 1
    issued = make_ca(out, days=args.days)
    print(f"CA: certificate {issued.cert}, key {issued.key}")
    return 0


def run_issue(args: argparse.Namespace) -> int:
    import logging
    from pathlib import Path

    from deltamesh.certs import Issued, issue

    ca = Issued(Path(args.ca) / "ca.pem", Path(args.ca) / "ca.key")
    if not ca.cert.exists() or not ca.key.exists():
        logging.getLogger(__name__).error("no CA in %s (make one with `deltamesh certs ca --out %s`)", args.ca, args.ca)
        return 1
    role, sep, holder = args.name.partition("/")
    if not sep or not role or not holder:
        logging.getLogger(__name__).error("--name must be ROLE/NAME, e.g. pool/eu-1, not %r", args.name)
        return 2
    issued = issue(ca, args.out, args.name, hosts=args.host, days=args.days)
    print(f"{args.name}: certificate {issued.cert}, key {issued.key}")
    return 0
