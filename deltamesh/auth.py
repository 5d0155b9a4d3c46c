"""Who may call which route of a deltamesh server: one policy table per server, enforced by middleware.

Each server declares a `Policy`: for every (method, route pattern) the roles that may call it
(`OPEN` for none needed, e.g. `/healthz`). `auth_middleware` identifies the caller before any
handler runs, by a bearer token (`deltamesh.tokens.TokenStore`) or, on an mTLS connection, by the
client certificate's common name written `ROLE/NAME` (a certificate vouches for a role and a name
but scopes no model ids). A route that the policy does not list is refused (fail closed), so a
route added without a decision cannot be called at all. A missing or unknown credential is a 401,
a known caller in the wrong role or asking for a model id outside its scope (the route's
`{model_id}`/`{model}`) a 403; both as `{"error": reason}`, and nothing runs. Handlers read the
caller with `identity(request)` to bind names (a pool speaks only for itself).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Awaitable, Callable, Mapping

from aiohttp import web

from deltamesh.tls import peer_identity
from deltamesh.tokens import ROLES, Identity, TokenStore, bearer_token

log = logging.getLogger(__name__)

OPEN: tuple[str, ...] = ()
"""Roles of a route anyone may call."""
IDENTITY_KEY = web.RequestKey("identity", Identity)
MODEL_PARAMS = ("model_id", "model")


@dataclass
class Policy:
    """Roles per (METHOD, canonical route path) of one server. `enabled` False: no authentication
    (a server explicitly run without credentials; every caller is anonymous and allowed)."""

    routes: Mapping[tuple[str, str], tuple[str, ...]]
    tokens: TokenStore | None = None
    enabled: bool = True
    denied: Callable[[int], None] = field(default=lambda status: None)
    """Called with the status of each refusal (for a metric)."""

    def roles_for(self, method: str, path: str) -> tuple[str, ...] | None:
        if method == "HEAD":
            method = "GET"
        return self.routes.get((method, path))


def _refuse(status: int, reason: str) -> web.Response:
    resp = web.json_response({"error": reason}, status=status)
    if status == 401:
        resp.headers["WWW-Authenticate"] = 'Bearer realm="deltamesh"'
    return resp


def caller(request: web.Request, tokens: TokenStore | None) -> Identity | None:
    """The caller's identity from its bearer token, else from its verified client certificate."""
    token = bearer_token(request.headers.get("Authorization"))
    if token is not None:
        return tokens.authenticate(token) if tokens is not None else None
    name = peer_identity(request.transport)
    if name:
        role, sep, holder = name.partition("/")
        if sep and role in ROLES and holder:
            return Identity(holder, role)
    return None


def auth_middleware(policy: Policy) -> Callable:
    @web.middleware
    async def middleware(request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        if not policy.enabled:
            return await handler(request)
        route = request.match_info.route
        resource = route.resource
        if resource is None:  # no route matched: let aiohttp answer 404/405
            return await handler(request)
        roles = policy.roles_for(request.method, resource.canonical)
        if roles is None:
            policy.denied(403)
            return _refuse(403, f"{request.method} {resource.canonical} is not open to any caller")
        if roles == OPEN:
            return await handler(request)
        who = caller(request, policy.tokens)
        if who is None:
            policy.denied(401)
            return _refuse(401, "a valid bearer token (or client certificate) is required")
        if who.role not in roles:
            policy.denied(403)
            return _refuse(403, f"{who.role} {who.name!r} may not call {request.method} {resource.canonical} "
                                f"(roles: {', '.join(roles)})")
        for param in MODEL_PARAMS:
            model = request.match_info.get(param)
            if model is not None and not who.may_use(model):
                policy.denied(403)
                return _refuse(403, f"{who.role} {who.name!r} may not act for model {model!r}")
        request[IDENTITY_KEY] = who
        return await handler(request)

    return middleware


def identity(request: web.Request) -> Identity | None:
    """The authenticated caller of this request (None on an open route or a server without auth)."""
    return request.get(IDENTITY_KEY)


def require_name(request: web.Request, name: str, what: str = "pool") -> None:
    """Refuse (403) a caller that speaks for another `what` than itself; admins may speak for anyone.
    A caller NAME also speaks for `NAME.SUFFIX`: a pool with several policies registers one weight
    stream per policy as `NAME.MODEL_ID`."""
    who = identity(request)
    if who is None or who.role == "admin" or speaks_for(who.name, name):
        return
    raise web.HTTPForbidden(text=json.dumps({"error": f"{who.role} {who.name!r} may not speak for {what} {name!r}"}),
                            content_type="application/json")


def speaks_for(holder: str, name: str) -> bool:
    """Whether the caller `holder` may act under `name`: its own, or `holder.SUFFIX` (`require_name`)."""
    return name == holder or name.startswith(holder + ".")


def unlisted_routes(app: web.Application, policy: Policy) -> list[str]:
    """Routes of `app` the policy says nothing about (a test asserts there are none)."""
    missing = []
    for route in app.router.routes():
        if route.method == "HEAD" or route.resource is None:
            continue
        if policy.roles_for(route.method, route.resource.canonical) is None:
            missing.append(f"{route.method} {route.resource.canonical}")
    return missing
