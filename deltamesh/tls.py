"""TLS for every deltamesh server and client: SSL contexts, peer identities, and the token-transport rule.

A process describes its TLS with one `TlsSettings` (a section of its config): the certificate and key
it presents (as a server, and as a client when a peer asks for one), the CA it verifies peers with
(the system store when empty), and whether its server requires client certificates (mTLS), whose
subject common name is then the caller's identity (`peer_identity`). Verification is never
downgraded: a failure is an error that names the peer and the reason. Bearer tokens are secrets, so
`check_token_transport` refuses to send one over plain HTTP to anything but a loopback address
unless `insecure` says the operator accepts that.
"""

from __future__ import annotations

import ipaddress
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from deltamesh.config_flags import flag


class TlsError(ValueError):
    """TLS settings that cannot work (a missing file, a key that does not fit) or a refused transport."""


@dataclass
class TlsSettings:
    """The `[SECTION.tls]` table of a process's config; flags `--tls-cert`, `--tls-key`, `--ca`,
    `--client-ca`, `--insecure`."""

    cert: str = field(default="", metadata=flag("--tls-cert", metavar="PEM"))
    """PEM certificate chain this process presents: its server certificate, and its client certificate
    when a peer requires one (mTLS). Empty: a plain-HTTP server, and no client certificate."""
    key: str = field(default="", metadata=flag("--tls-key", metavar="PEM"))
    """PEM private key of `cert`."""
    ca: str = field(default="", metadata=flag("--ca", metavar="PEM"))
    """PEM bundle of the CAs that peers' certificates must chain to; empty: the system store."""
    client_ca: str = field(default="", metadata=flag("--client-ca", metavar="PEM"))
    """Servers only: require a client certificate chaining to this PEM bundle (mTLS); empty: none asked."""
    insecure: bool = field(default=False, metadata=flag("--insecure"))
    """Allow bearer tokens over plain HTTP to hosts that are not loopback (never needed with https://)."""

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            raise ValueError("tls cert and key go together: give both or neither")
        for name in ("cert", "key", "ca", "client_ca"):
            value = getattr(self, name)
            if value and not Path(value).is_file():
                raise ValueError(f"tls {name} {value!r} is not a file")

    @property
    def serves_tls(self) -> bool:
        return bool(self.cert)


def server_context(settings: TlsSettings) -> ssl.SSLContext | None:
    """The SSL context a server listens with, or None for plain HTTP (no certificate configured)."""
    if not settings.serves_tls:
        if settings.client_ca:
            raise TlsError("client_ca (mTLS) needs a server certificate: set tls cert and key")
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, settings)
    if settings.client_ca:
        ctx.verify_mode = ssl.CERT_REQUIRED
        ctx.load_verify_locations(cafile=settings.client_ca)
    return ctx


def client_context(settings: TlsSettings) -> ssl.SSLContext:
    """The SSL context clients verify servers with (hostname checked), presenting `cert` if set."""
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=settings.ca or None)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.serves_tls:
        _load_chain(ctx, settings)
    return ctx


def _load_chain(ctx: ssl.SSLContext, settings: TlsSettings) -> None:
    try:
        ctx.load_cert_chain(settings.cert, settings.key)
    except (ssl.SSLError, OSError) as e:
        raise TlsError(f"cannot load tls cert {settings.cert} with key {settings.key}: {e}") from e


def peer_identity(transport: Any) -> str | None:
    """The common name of the verified client certificate on `transport` (None without one)."""
    if transport is None:
        return None
    cert = transport.get_extra_info("peercert")
    if not cert:
        return None
    for rdn in cert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return None


def is_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_token_transport(url: str, insecure: bool) -> None:
    """Raise TlsError if a bearer token would travel in clear text to `url` (plain HTTP, not loopback)."""
    scheme = urlsplit(url).scheme
    if scheme == "https" or insecure or is_loopback(url):
        return
    raise TlsError(f"refusing to send a token over plain {scheme}:// to {url}: use https:// "
                   "(or --insecure to accept clear-text tokens on this network)")
