"""Settings of `deltamesh console` (the `[console]` table): what it reads, with which credentials, and
how it serves the page.

The console reads the mesh server side: gateways (`gateways`, more found through their links), the
broker, optionally trainers' metrics, each with the console's own tokens; the browser never gets
them. It listens on loopback by default. Listening anywhere else requires TLS (`tls.cert`) and a
login token of its own (`login_token`), checked here, so a console reachable from the network is
never served in clear text or without a login.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deltamesh.config import http_url, http_urls
from deltamesh.config_flags import flag
from deltamesh.http import parse_listen
from deltamesh.tls import TlsSettings, check_token_transport, is_loopback


@dataclass
class ConsoleConfig:
    """The console: where it serves, which services of the mesh it reads, and how often."""

    listen: str = field(default="127.0.0.1:8790", metadata=flag(metavar="HOST:PORT"))
    """Address the console serves its page on. Anything but loopback needs tls cert/key and a login token."""
    gateways: list[str] = field(default_factory=list, metadata=flag("--gateway", metavar="URL"))
    """Gateway base URLs to read with `token` (only these get it); their pools are found from their listings,
    and a relay announced to them is drawn from their links."""
    token: str = field(default="", metadata=flag("--token", metavar="TOKEN", secret_env="DELTAMESH_TOKEN"))
    """The console's token at the gateways: an admin token shows every panel (pools, links, version
    listings are admin routes); a metrics token shows what the gateways' /metrics carry."""
    broker: str = field(default="", metadata=flag(metavar="URL"))
    """Base URL of the broker (several separated by commas); empty: no broker panel."""
    broker_token: str = field(default="", metadata=flag(metavar="TOKEN", secret_env="DELTAMESH_BROKER_TOKEN"))
    """The console's token at the broker: admin (queues, rates and the balance report) or metrics (all but
    the balance report)."""
    trainers: list[str] = field(default_factory=list, metadata=flag("--trainer", metavar="URL"))
    """Trainers' metrics servers (their `metrics_listen`), for each pool's trainer-side mismatch."""
    login_token: str = field(default="", metadata=flag(metavar="TOKEN", secret_env="DELTAMESH_CONSOLE_LOGIN_TOKEN"))
    """The token a browser must show (once, on the login page) to see the console; required off loopback.
    Empty on loopback: anyone on this host may look."""
    poll_s: float = 1.0
    """Seconds between two reads of the mesh (the page asks as often)."""
    timeout_s: float = 3.0
    """How long one read of one service may take before it counts as not answering."""
    keep_versions: int = 100
    """Versions per model whose timelines the console keeps and shows."""
    stale_after_s: float = 30.0
    """A pool behind its model's head for longer than this is flagged stale (so is a pool whose gateway
    does not answer, or that its gateway lists down)."""
    read_pools: bool = True
    """Read each pool's own status server (its registered endpoint) for its proof, timeline and rates."""
    tls: TlsSettings = field(default_factory=TlsSettings)
    """`cert`/`key`: the console serves HTTPS and presents them to services asking for a client
    certificate; `ca`: verifies https:// services."""

    def __post_init__(self) -> None:
        host, _ = parse_listen(self.listen)
        if not is_loopback(f"http://{host}") and not (self.tls.serves_tls and self.login_token):
            raise ValueError(f"a console listening on {self.listen} (not loopback) must serve HTTPS (tls cert and "
                             "key) and ask for its own login token (login_token, --login-token-file)")
        self.gateways = [http_url(url, "gateway") for url in self.gateways]
        if self.broker:
            self.broker = http_urls(self.broker, "broker")
        self.trainers = [http_url(url, "trainer") for url in self.trainers]
        if not (self.gateways or self.broker):
            raise ValueError("the console needs at least one gateway (--gateway URL) or a broker (--broker URL)")
        for url in self.gateways if self.token else []:
            check_token_transport(url, self.tls.insecure)
        for url in self.broker.split(",") if self.broker_token else []:
            check_token_transport(url, self.tls.insecure)
        if not (self.poll_s > 0 and self.timeout_s > 0 and self.stale_after_s >= 0):
            raise ValueError("poll_s and timeout_s must be > 0, stale_after_s >= 0")
        if not 1 <= self.keep_versions <= 10_000:
            raise ValueError(f"keep_versions must be in 1..10000, got {self.keep_versions}")
