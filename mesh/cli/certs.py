"""`deltamesh certs ca|issue`: a small certificate authority for a mesh's TLS (see docs/SECURITY.md).

`ca --out DIR` writes DIR/ca.pem and DIR/ca.key; `issue --ca DIR --name ROLE/NAME --host H... --out
DIR` writes a certificate for servers (the hosts) and clients (the name: a server that requires client
certificates takes ROLE/NAME as the caller's identity). Keys are written with mode 0600; an existing
CA is never overwritten without --force.
"""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, pool_commands: argparse._SubParsersAction) -> None:
    from deltamesh.mesh.cli import command_group

    sub = command_group(commands, "certs", help="make a CA and TLS certificates for gateways, brokers, pools, trainers")
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


def run_ca(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deltamesh.certs import make_ca
    from deltamesh.mesh.cli import failed

    out = Path(args.out)
    if not args.force and ((out / "ca.pem").exists() or (out / "ca.key").exists()):
        return failed(f"{out} already holds a CA; pass --force to replace it", 1)
    issued = make_ca(out, days=args.days)
    print(f"CA: certificate {issued.cert}, key {issued.key}")
    return 0


def run_issue(args: argparse.Namespace) -> int:
    from pathlib import Path

    from deltamesh.certs import Issued, issue
    from deltamesh.mesh.cli import failed

    ca = Issued(Path(args.ca) / "ca.pem", Path(args.ca) / "ca.key")
    if not ca.cert.exists() or not ca.key.exists():
        return failed(f"no CA in {args.ca} (make one with `deltamesh certs ca --out {args.ca}`)", 1)
    role, sep, holder = args.name.partition("/")
    if not sep or not role or not holder:
        return failed(f"--name must be ROLE/NAME, e.g. pool/eu-1, not {args.name!r}")
    issued = issue(ca, args.out, args.name, hosts=args.host, days=args.days)
    print(f"{args.name}: certificate {issued.cert}, key {issued.key}")
    return 0
