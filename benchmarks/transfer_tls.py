"""TLS for the transfer benchmark: a CA made for the run, gateway certificates, and agents' `--ca`.

The TLS methods of the long-link scenario (`deltamesh_tls`, `deltamesh_tls_warm`) run a second origin
gateway that serves HTTPS with a certificate of the run's CA (ECDSA P-256 from `deltamesh.certs`,
naming the host's own address), and every agent that talks to it (the publisher, the puller, the
probes that read its /healthz and /metrics) verifies it against that CA, given with `--ca`. The
gateway runs `--anonymous` like the plain one, so the two differ in the transport alone.
"""

from __future__ import annotations

import argparse
import ssl
from pathlib import Path

from deltamesh.tls import TlsSettings, client_context


class RunPki:
    """The run's CA (made on first use) and the server certificates it signs, under `folder`."""

    def __init__(self, folder: Path):
        self.folder = folder
        self._ca = None

    @property
    def ca(self) -> Path:
        return self._authority().cert

    def server_flags(self, ip: str, region: str) -> list[str]:
        """`deltamesh gateway` flags serving HTTPS with a new certificate for `ip` (gateway/REGION)."""
        from deltamesh.certs import issue

        cert = issue(self._authority(), self.folder, f"gateway/{region}", hosts=[ip], file_stem=f"gateway-{region}")
        return ["--tls-cert", str(cert.cert), "--tls-key", str(cert.key)]

    def _authority(self):
        if self._ca is None:
            from deltamesh.certs import make_ca

            self._ca = make_ca(self.folder / "ca")
        return self._ca


def add_ca_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ca", help="PEM CA that https:// servers are verified against (the run's own)")


def client_tls(args: argparse.Namespace) -> TlsSettings | None:
    """What an agent's client session verifies https:// gateways with (None: the default store)."""
    return TlsSettings(ca=args.ca) if args.ca else None


def url_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    """The same for `urllib` probes."""
    return client_context(TlsSettings(ca=args.ca)) if args.ca else None
