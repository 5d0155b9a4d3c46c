"""`GatewayClient`: the one place that knows a gateway's `/v1/` URLs (see docs/api/gateway.md).

Publishers, relays, pools, the trainer, the CLI and the demo all reach a gateway through it: it
builds every path, sends JSON with the project's one HTTP helper (`deltamesh.http`) and hands back
the decoded answer, raising `HttpError` with the gateway's reason on failure. Bulk transfers
(manifests and pieces) stay with the fetcher, which asks `version_url` where a version lives. It
holds no state beyond the base URL, the session it was given and the headers every call carries
(the caller's peer name, its token), so one is cheap to make per call site. Every route but
`/healthz` needs a credential: the token rides on every call, and a client refuses (TlsError) to be
made with one for plain http:// to a host that is not loopback unless `insecure`; a client
certificate, when the session presents one, needs no token.
"""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable, Mapping, TypeVar

import aiohttp

from deltamesh.http import bearer, client_session, request_json
from deltamesh.tls import TlsSettings, check_token_transport

T = TypeVar("T")

PEER_HEADER = "X-Deltamesh-Peer"
"""Names the caller (`pool/NAME`, `gateway/REGION`, `trainer/MODEL`) so a gateway can attribute links."""


MODELS_PATH = "/v1/models"
"""What a gateway serves (GET); below it, each model's routes (`model_path`)."""
HEADS_PATH = "/v1/heads"
"""Every model's head (GET, long-polled): what relays follow."""
LINKS_PATH = "/v1/links"
"""The gateway's links and their measurements (GET, admin)."""
GATEWAYS_PATH = "/v1/gateways"
"""Where a downstream gateway announces itself to its upstream (POST)."""


def model_path(model: str, what: str) -> str:
    """`/v1/models/{model}/{what}`: a model's `head`, `plan`, `versions`, `traffic`, `statement` or
    `newest/{kind}/parts` route on a gateway."""
    return f"{MODELS_PATH}/{model}/{what}"


def version_url(base: str, model: str, version: int, kind: str) -> str:
    """Where a gateway at `base` serves one version: `/manifest` and `/pieces/{index}` below it."""
    return f"{base.rstrip('/')}{model_path(model, f'versions/{version}/{kind}')}"


def staged_url(base: str, model: str, piece_hash: str) -> str:
    """Where the origin at `base` takes (PUT) a piece of `model` before the manifest that names it."""
    return f"{base.rstrip('/')}{model_path(model, f'staged/{piece_hash}')}"


def statement_url(base: str, model: str) -> str:
    """Where a gateway at `base` serves (GET) and, the origin, takes (PUT) `model`'s signed head statement."""
    return f"{base.rstrip('/')}{model_path(model, 'statement')}"


class GatewayClient:
    """JSON calls to one gateway at `base` over `session`, as `peer`, with `token` (if any) on every call."""

    def __init__(self, base: str, session: aiohttp.ClientSession, *, peer: str | None = None,
                 token: str | None = None, insecure: bool = False, timeout_s: float | None = 30.0) -> None:
        self.base = base.rstrip("/")
        self.session = session
        self.timeout_s = timeout_s
        self._headers = {PEER_HEADER: peer} if peer else {}
        if token:
            check_token_transport(self.base, insecure)
            self._headers.update(bearer(token))

    def url(self, path: str) -> str:
        return f"{self.base}{path}"

    def version_url(self, model: str, version: int, kind: str) -> str:
        return version_url(self.base, model, version, kind)

    async def _call(self, method: str, path: str, *, params: Mapping[str, Any] | None = None, body: Any = None,
                    timeout_s: float | None = None) -> Any:
        return await request_json(self.session, method, self.url(path), params=params, body=body, headers=self._headers,
                                  timeout_s=self.timeout_s if timeout_s is None else timeout_s)

    # -- models and versions ---------------------------------------------------------------------------
    async def models(self) -> dict[str, Any]:
        """`{"region", "models": {model: {...}}}`: what the gateway serves."""
        return await self._call("GET", MODELS_PATH)

    async def head(self, model: str, *, after: int | None = None, wait_s: float = 0.0) -> int | None:
        """The newest version of `model`; with `after`, waits up to `wait_s` for one newer than it."""
        answer = await self._call("GET", model_path(model, "head"), params={"after": after, "wait": wait_s},
                                  timeout_s=None if self.timeout_s is None else self.timeout_s + wait_s)
        return answer["head"]

    async def heads(self, params: Mapping[str, Any], *, timeout_s: float | None = None) -> dict[str, Any]:
        """Every model's head (`GET /v1/heads`), long-polled as `params` say."""
        return await self._call("GET", HEADS_PATH, params=params, timeout_s=timeout_s)

    async def versions(self, model: str) -> dict[str, Any]:
        """The listing of `model`'s versions: `{"head", "versions": [...]}`."""
        return await self._call("GET", model_path(model, "versions"))

    async def plan(self, model: str, params: Mapping[str, Any]) -> dict[str, Any]:
        """A transfer plan (`from`, `to`, `since_full`, `full_every`, ...), as JSON for `Plan.from_json`."""
        return await self._call("GET", model_path(model, "plan"), params=params)

    # -- pools, gateways, links ------------------------------------------------------------------------
    async def register_pool(self, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._call("POST", "/v1/pools", body=dict(body))

    async def heartbeat(self, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        return await self._call("POST", f"/v1/pools/{name}/heartbeat", body=dict(body))

    async def deregister_pool(self, name: str) -> dict[str, Any]:
        """Leave the gateway's registry (`DELETE /v1/pools/{name}`): a pool for itself, or an admin."""
        return await self._call("DELETE", f"/v1/pools/{name}")

    async def pools(self) -> dict[str, Any]:
        return await self._call("GET", "/v1/pools")

    async def links(self) -> dict[str, Any]:
        return await self._call("GET", LINKS_PATH)

    async def announce(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """Tell an upstream gateway that a downstream one follows it (`POST /v1/gateways`); the answer
        says how long the announcement holds (`ttl_s`)."""
        return await self._call("POST", GATEWAYS_PATH, body=dict(body))


def call_once(base: str, call: Callable[[GatewayClient], Awaitable[T]], *, timeout_s: float = 10.0,
              token: str | None = None, tls: TlsSettings | None = None) -> T:
    """One call from synchronous code (the CLI's tables): a session (TLS as `tls` says) is opened and
    closed around it. Raises `HttpError`, or TlsError for a token that would travel in clear text."""
    insecure = tls.insecure if tls is not None else False

    async def run() -> T:
        async with client_session(connections=2, timeout_s=timeout_s, tls=tls) as session:
            # The client refuses a clear-text token before anything is sent.
            return await call(GatewayClient(base, session, token=token, insecure=insecure, timeout_s=timeout_s))
    return asyncio.run(run())
