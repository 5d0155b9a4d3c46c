"""The demo mesh's credentials: its own CA, a certificate per server, and a token per caller.

`deltamesh demo` runs over TLS by default so that the secured path is the one exercised every day:
each gateway and the broker serve HTTPS with a certificate of the run's CA (for 127.0.0.1), every
client verifies them against that CA, and every caller presents a token of its role from one tokens
file that the gateways and the broker share (roles do not overlap: the broker ignores gateway
tokens and the other way round). Relays pull from their upstreams with a gateway token named after
their region; each pool's token is named after the pool; each trainer's is scoped to its model id;
the demo's monitor reads everything as an admin. Everything lives under RUN_DIR/pki, keys mode 0600;
each caller's token is also in a file of its own (`token_files`, mode 0600), which its service reads
with `--token-file` and the like: a token never goes on a command line (`ps`) nor in a config file.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Sequence

from deltamesh.certs import Issued, issue, make_ca
from deltamesh.tls import TlsSettings
from deltamesh.tokens import TokenSpec, add_token, save_token

ADMIN = "demo-monitor"


@dataclass
class MeshCredentials:
    ca: Path
    tokens_file: Path
    certs: dict[str, Issued] = field(default_factory=dict)
    """Server name (`gateway-REGION`, `broker`, `eval`) -> its certificate and key."""
    tokens: dict[str, str] = field(default_factory=dict)
    """Caller (`gateway/REGION`, `pool/NAME`, `trainer/MODEL`, `admin`) -> its token."""
    token_files: dict[str, Path] = field(default_factory=dict)
    """Caller -> the file (mode 0600) holding its token, for its service's `--token-file`-style flag."""

    def client_tls(self) -> TlsSettings:
        """What every client of the mesh verifies servers with."""
        return TlsSettings(ca=str(self.ca))

    def server_flags(self, server: str) -> list[str]:
        cert = self.certs[server]
        return ["--tokens-file", str(self.tokens_file), "--tls-cert", str(cert.cert), "--tls-key", str(cert.key),
                "--ca", str(self.ca)]


def make_credentials(pki: Path, regions: Sequence[str], pools: Sequence[str], model_ids: Sequence[str],
                     hosts: Mapping[str, Sequence[str]] | None = None, evaluator: str = "") -> MeshCredentials:
    """A CA, server certificates for every gateway and the broker (and the evaluator, when named: it
    follows its gateway with a pool token of its own name), and a token for every caller.
    `hosts`: server name -> the addresses its certificate names (default 127.0.0.1, where the demo's
    servers listen)."""
    ca = make_ca(pki / "ca")
    creds = MeshCredentials(ca.cert, pki / "tokens.toml")
    for server in [*(f"gateway-{r}" for r in regions), "broker", *(["eval"] if evaluator else [])]:
        role, _, name = server.partition("-")
        names = list((hosts or {}).get(server, ["127.0.0.1"]))
        creds.certs[server] = issue(ca, pki, f"{role}/{name or 'main'}", hosts=names, file_stem=server)
    for region in regions:
        creds.tokens[f"gateway/{region}"] = add_token(creds.tokens_file, TokenSpec(region, "gateway"))
    for pool in [*pools, *([evaluator] if evaluator else [])]:
        creds.tokens[f"pool/{pool}"] = add_token(creds.tokens_file, TokenSpec(pool, "pool", list(model_ids)))
    for model_id in model_ids:
        creds.tokens[f"trainer/{model_id}"] = add_token(creds.tokens_file,
                                                        TokenSpec(f"{model_id}-trainer", "trainer", [model_id]))
    creds.tokens["admin"] = add_token(creds.tokens_file, TokenSpec(ADMIN, "admin"))
    folder = pki / "tokens"
    folder.mkdir(mode=0o700, exist_ok=True)
    for caller, token in creds.tokens.items():
        creds.token_files[caller] = folder / f"{caller.replace('/', '-')}.token"
        save_token(creds.token_files[caller], token, replace=True)
    return creds
