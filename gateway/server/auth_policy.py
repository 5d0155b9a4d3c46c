"""Who may call which gateway route: the gateway's route table for `deltamesh.auth`, and its start-up rule.

The weights are the lab's asset, so every route but `/healthz` needs a credential: a bearer token
from the gateway's tokens file or, on an mTLS connection, a client certificate whose common name is
`ROLE/NAME`. `trainer` publishes versions and head statements (scoped to the model ids of its
token), `pool` reads what a pool needs and speaks for its own name only (the handlers bind it with
`require_name`), `gateway` is a downstream relay (it follows, fetches and announces itself), `admin`
reads everything, and `metrics` scrapes. A route missing from `ROUTES` is refused by the middleware,
and a test asserts that none is. A gateway with no way to tell its callers apart (no tokens file, no
client CA) refuses to start unless it is explicitly `anonymous`.
"""

from __future__ import annotations

import logging
from typing import Callable

from deltamesh.auth import OPEN, Policy
from deltamesh.gateway.config import GatewayConfig
from deltamesh.tokens import TokenStore

log = logging.getLogger(__name__)

_MODEL = "/v1/models/{model}"
_VERSION = _MODEL + "/versions/{version}/{kind}"

READ_WEIGHTS = ("pool", "gateway", "trainer", "admin")
"""Manifests, pieces and plans: what a pool applies and a relay mirrors, and what a restarted trainer
rebuilds its base from when the gateway holds versions newer than its checkpoint."""
READ_HEADS = ("pool", "gateway", "trainer", "admin")
"""Version numbers of one model: a publisher continues after the head, pools and relays follow it."""

ROUTES: dict[tuple[str, str], tuple[str, ...]] = {
    ("GET", "/healthz"): OPEN,
    ("GET", "/metrics"): ("metrics", "admin"),
    ("GET", "/v1/heads"): ("gateway", "admin"),
    ("GET", "/v1/models"): ("pool", "gateway", "admin"),
    ("GET", _MODEL + "/head"): READ_HEADS,
    ("GET", _MODEL + "/versions"): READ_HEADS,
    ("GET", _MODEL + "/plan"): READ_WEIGHTS,
    ("GET", _MODEL + "/traffic"): ("admin", "metrics"),
    ("GET", _VERSION + "/manifest"): READ_WEIGHTS,
    ("GET", _VERSION + "/pieces/{index}"): READ_WEIGHTS,
    ("GET", _MODEL + "/newest/{kind}/parts/{part}"): READ_WEIGHTS,
    ("PUT", _VERSION + "/manifest"): ("trainer",),
    ("PUT", _VERSION + "/pieces/{index}"): ("trainer",),
    ("PUT", _MODEL + "/staged/{digest}"): ("trainer",),
    ("GET", _MODEL + "/statement"): ("pool", "gateway", "admin"),
    ("PUT", _MODEL + "/statement"): ("trainer",),
    ("POST", "/v1/pools"): ("pool",),
    ("POST", "/v1/pools/{name}/heartbeat"): ("pool",),
    ("DELETE", "/v1/pools/{name}"): ("pool", "admin"),
    ("GET", "/v1/pools"): ("admin",),
    ("GET", "/v1/links"): ("admin",),
    ("POST", "/v1/gateways"): ("gateway",),
}


def gateway_policy(config: GatewayConfig, denied: Callable[[int], None]) -> Policy:
    """The policy a gateway serves with; ValueError (or TokenError) when it has no credentials to check
    and was not told to run without, or its tokens file does not load. Client certificates alone (a
    client CA, no tokens file) are credentials enough."""
    if not (config.tokens_file or config.tls.client_ca or config.anonymous):
        raise ValueError("the gateway needs a tokens file (tokens_file, --tokens-file) or client certificates "
                         "(--client-ca), or anonymous = true (--anonymous) for a gateway no one else can reach")
    if config.anonymous:
        log.warning("gateway %s serves without authentication (anonymous = true): every caller may read "
                    "and publish weights", config.region)
        return Policy(ROUTES, None, enabled=False, denied=denied)
    return Policy(ROUTES, TokenStore(config.tokens_file or None), denied=denied)
