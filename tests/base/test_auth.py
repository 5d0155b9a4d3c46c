"""The policy middleware: every route decided, callers identified by token or client certificate."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web

from deltamesh.auth import OPEN, Policy, auth_middleware, identity, require_name, unlisted_routes
from deltamesh.certs import issue, make_ca
from deltamesh.http import HttpError, bearer, client_session, request_json, serving
from deltamesh.tls import TlsSettings, server_context
from deltamesh.tokens import TokenSpec, TokenStore, add_token


def build(policy: Policy, changed: list) -> web.Application:
    app = web.Application(middlewares=[auth_middleware(policy)])

    async def write(request: web.Request) -> web.Response:
        require_name(request, request.match_info["pool"])
        changed.append((request.match_info["model_id"], identity(request).name))
        return web.json_response({"ok": True})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def forgotten(request: web.Request) -> web.Response:
        changed.append("forgotten")
        return web.json_response({"ok": True})

    app.router.add_post("/v1/models/{model_id}/pools/{pool}", write)
    app.router.add_get("/healthz", health)
    app.router.add_post("/v1/forgotten", forgotten)
    return app


ROUTES = {("POST", "/v1/models/{model_id}/pools/{pool}"): ("pool", "admin"), ("GET", "/healthz"): OPEN}


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens.toml"
    return path, {
        "pool": add_token(path, TokenSpec("eu-1", "pool", ["policy"])),
        "other_pool": add_token(path, TokenSpec("eu-2", "pool")),
        "trainer": add_token(path, TokenSpec("t", "trainer")),
        "admin": add_token(path, TokenSpec("ops", "admin")),
    }


def run(app: web.Application, requests, *, tls=None, ssl_context=None) -> list:
    """Serve `app` once and make each (method, path, headers) request; each answer or HttpError."""
    async def go():
        out = []
        async with serving(app, "127.0.0.1:0", ssl_context=ssl_context) as url, \
                client_session(tls=tls, timeout_s=10) as s:
            for method, path, headers in requests:
                try:
                    out.append(await request_json(s, method, f"{url}{path}", headers=headers))
                except HttpError as e:
                    out.append(e)
        return out
    return asyncio.run(go())


def statuses(answers) -> list[int]:
    return [a.status if isinstance(a, HttpError) else 200 for a in answers]


def test_each_caller_gets_exactly_its_routes(tokens):
    path, tok = tokens
    changed: list = []
    app = build(Policy(ROUTES, TokenStore(path)), changed)
    write = "/v1/models/policy/pools/eu-1"
    refused = run(app, [
        ("POST", write, None),                                   # no token
        ("POST", write, bearer("dm_not-a-token")),               # unknown token
        ("POST", write, bearer(tok["trainer"])),                 # wrong role
        ("POST", write, bearer(tok["other_pool"])),              # another pool's name
        ("POST", "/v1/models/other/pools/eu-1", bearer(tok["pool"])),  # model out of its scope
        ("POST", "/v1/forgotten", bearer(tok["admin"])),         # no policy for the route: closed
    ])
    assert statuses(refused) == [401, 401, 403, 403, 403, 403]
    assert changed == []
    app = build(Policy(ROUTES, TokenStore(path)), changed)
    allowed = run(app, [("GET", "/healthz", None), ("POST", write, bearer(tok["pool"])),
                        ("POST", write, bearer(tok["admin"]))])  # admins speak for anyone
    assert statuses(allowed) == [200, 200, 200]
    assert changed == [("policy", "eu-1"), ("policy", "ops")]
    assert unlisted_routes(app, Policy(ROUTES)) == ["POST /v1/forgotten"]


def test_refusals_say_why(tokens):
    path, tok = tokens
    app = build(Policy(ROUTES, TokenStore(path)), [])
    write = "/v1/models/policy/pools/eu-1"
    answers = run(app, [("POST", write, None), ("POST", write, bearer(tok["trainer"])),
                        ("POST", write, bearer(tok["other_pool"]))])
    assert "bearer token" in str(answers[0])
    assert "trainer 't' may not call POST" in str(answers[1])
    assert "may not speak for pool 'eu-1'" in str(answers[2])


def test_a_client_certificate_names_role_and_holder(tmp_path):
    ca = make_ca(tmp_path / "ca")
    server = issue(ca, tmp_path, "gateway/origin", hosts=["127.0.0.1"])
    pool_cert = issue(ca, tmp_path, "pool/eu-1")
    trainer_cert = issue(ca, tmp_path, "trainer/t")
    server_tls = TlsSettings(cert=str(server.cert), key=str(server.key), client_ca=str(ca.cert))
    changed: list = []
    app = build(Policy(ROUTES, TokenStore()), changed)

    def as_holder(cert):
        return TlsSettings(cert=str(cert.cert), key=str(cert.key), ca=str(ca.cert))

    write = [("POST", "/v1/models/policy/pools/eu-1", None)]
    assert run(app, write, tls=as_holder(pool_cert), ssl_context=server_context(server_tls)) == [{"ok": True}]
    app = build(Policy(ROUTES, TokenStore()), changed)
    assert statuses(run(app, write, tls=as_holder(trainer_cert), ssl_context=server_context(server_tls))) == [403]
    assert changed == [("policy", "eu-1")]


def test_a_server_without_auth_lets_everyone_in():
    changed: list = []
    app = build(Policy(ROUTES, enabled=False), changed)
    assert run(app, [("POST", "/v1/forgotten", None)]) == [{"ok": True}]
