"""Who may call which gateway route, with real tokens over a real socket: every route is decided, every
refusal (no token, an unknown one, a wrong role, another pool's name, another model) is a 401/403
that changes nothing, pools speak only for themselves, and a revoked token stops at its next call."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
from pathlib import Path

import pytest

from deltamesh.auth import OPEN, unlisted_routes
from deltamesh.delta import piece_digest, sign_statement
from deltamesh.gateway.server.app import GATEWAY_KEY, create_app
from deltamesh.gateway.server.auth_policy import ROUTES, gateway_policy
from deltamesh.http import bearer, client_session, serving
from deltamesh.tokens import ROLES, TokenSpec, add_token, revoke_token

MODEL = "tiny-1"


@pytest.fixture
def tokens(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """One token per caller: each role, a second pool, a second gateway, a trainer of another model."""
    path = tmp_path / "tokens.toml"
    specs = {"trainer": TokenSpec("trainer-1", "trainer", [MODEL]), "pool": TokenSpec("p1", "pool"),
             "gateway": TokenSpec("A", "gateway"), "admin": TokenSpec("ops", "admin"),
             "metrics": TokenSpec("prom", "metrics"), "pool2": TokenSpec("p2", "pool"),
             "gateway2": TokenSpec("B", "gateway"), "other_trainer": TokenSpec("trainer-2", "trainer", ["other"])}
    return path, {who: add_token(path, spec) for who, spec in specs.items()}


@contextlib.asynccontextmanager
async def gateway(kit, tmp_path: Path, tokens_file: Path, **kw):
    """An origin with a tokens file, v1 full announced with one of its pieces, pool p1 registered."""
    app = create_app(kit.config(tmp_path, tokens_file=str(tokens_file), **kw))
    async with serving(app, "127.0.0.1:0") as url, client_session(timeout_s=10) as s:
        yield url, s, app[GATEWAY_KEY]


async def call(s, method: str, url: str, token: str | None = None, **kw) -> tuple[int, dict]:
    headers = {**kw.pop("headers", {}), **(bearer(token) if token else {})}
    async with s.request(method, url, headers=headers, **kw) as resp:
        raw = await resp.read()
        try:
            return resp.status, json.loads(raw)
        except ValueError:
            return resp.status, {"raw": raw[:100]}


TWO_POOLS = (("pool", "p1"), ("pool2", "p2"))
"""(token, pool name) of two pools, each registering with its own token."""


@contextlib.asynccontextmanager
async def gateway_with_two_pools(kit, tmp_path: Path, tokens: tuple[Path, dict[str, str]]):
    """`gateway`, with the two pools of TWO_POOLS registered."""
    path, tok = tokens
    async with gateway(kit, tmp_path, path) as (url, s, gw):
        for who, name in TWO_POOLS:
            status, body = await call(s, "POST", f"{url}/v1/pools", tok[who], json={"name": name, "model": MODEL})
            assert status == 201, body
        yield url, s, gw


def state(gw) -> tuple:
    """Everything a call could change: versions and their pieces, the epoch, pools, downstreams, the ledger,
    the head statement."""
    versions = [(m, e.version, e.kind, sorted(e.present)) for m in gw.store.models() for e in gw.store.entries(m)]
    pools = [(p.name, p.version, p.state, p.last_seen) for p in gw.pools.pools()]
    statement = gw.statements.get(MODEL)
    return (versions, gw.store.epoch, pools, sorted(d.region for d in gw.downstreams), gw.store.ledger.top(MODEL),
            statement.raw if statement is not None else None, gw.store.staging.staged())


def statement(kit, issued_ms: int) -> bytes:
    """A head statement of the v1 that `setup` publishes, issued at `issued_ms`."""
    m, _, _ = kit.version(MODEL, 1, "full")
    return sign_statement(kit.key.key, MODEL, 1, m.weights_hash, issued_ms)


def requests(kit) -> dict[tuple[str, str], dict]:
    """A concrete request per route: the path and a body that would change state if it were let through."""
    _, raw2, _ = kit.version(MODEL, 2, "delta")
    _, _, pieces1 = kit.version(MODEL, 1, "full")
    one = f"/v1/models/{MODEL}/versions/1/full"
    paths = {
        "/v1/models/{model}/versions/{version}/{kind}/manifest": (one + "/manifest",
                                                                  f"/v1/models/{MODEL}/versions/2/delta/manifest"),
        "/v1/models/{model}/versions/{version}/{kind}/pieces/{index}": (one + "/pieces/0", one + "/pieces/1"),
        "/v1/models/{model}/newest/{kind}/parts/{part}": (f"/v1/models/{MODEL}/newest/full/parts/0?of=2",) * 2,
        "/v1/models/{model}/staged/{digest}": (f"/v1/models/{MODEL}/staged/{piece_digest(pieces1[1])}",) * 2,
    }
    out = {}
    for method, route in ROUTES:
        if route in paths:
            path = paths[route][method == "PUT"]
        else:
            path = route.replace("{model}", MODEL).replace("{name}", "p1")
        kw: dict = {}
        if (method, route) == ("PUT", "/v1/models/{model}/versions/{version}/{kind}/manifest"):
            kw["data"] = raw2
        elif (method, route) == ("PUT", "/v1/models/{model}/statement"):
            kw["data"] = statement(kit, 2_000_000_000_000)  # newer than setup's
        elif method == "PUT":
            kw["data"] = pieces1[1]
        elif route == "/v1/pools":
            kw["json"] = {"name": "p1", "model": MODEL, "gpus": 1, "version": 1}
        elif route == "/v1/pools/{name}/heartbeat":
            kw["json"] = {"version": 1, "state": "idle"}
        elif route == "/v1/gateways":
            kw["json"] = {"region": "A", "url": "http://127.0.0.1:9"}
        out[(method, route)] = {"path": path, **kw}
    return out


async def setup(kit, url, s, tok) -> None:
    m, raw, pieces = kit.version(MODEL, 1, "full")
    status, _ = await call(s, "PUT", f"{url}/v1/models/{MODEL}/versions/1/full/manifest", tok["trainer"], data=raw)
    assert status == 201
    status, _ = await call(s, "PUT", f"{url}/v1/models/{MODEL}/versions/1/full/pieces/0", tok["trainer"], data=pieces[0])
    assert status == 201
    status, _ = await call(s, "POST", f"{url}/v1/pools", tok["pool"], json={"name": "p1", "model": MODEL})
    assert status == 201
    status, _ = await call(s, "PUT", f"{url}/v1/models/{MODEL}/statement", tok["trainer"],
                           data=statement(kit, 1_000_000_000_000))
    assert status == 201


def test_every_route_is_decided(kit, tmp_path, tokens):
    path, _ = tokens
    for cfg in (kit.config(tmp_path, tokens_file=str(path)),
                kit.config(tmp_path, tokens_file=str(path), upstreams=["http://127.0.0.1:9"])):
        policy = gateway_policy(cfg, denied=lambda status: None)
        assert unlisted_routes(create_app(cfg), policy) == []
        assert policy.roles_for("GET", "/healthz") == OPEN
        assert [r for r, roles in ROUTES.items() if roles == OPEN] == [("GET", "/healthz")]


def documented_routes() -> dict[tuple[str, str], tuple[str, ...]]:
    """The route table of docs/api/gateway.md, "Who may call what", as (method, route) -> roles; a route
    written `.../SUFFIX` is the route of the code's table ending in SUFFIX."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "api" / "gateway.md").read_text()
    table = text[text.index("| route | who may call it |"):]
    out = {}
    for row in table[:table.index("\n\n")].splitlines()[2:]:
        routes, who = row.strip("|").split("|")
        roles = tuple(r for r in ROLES if re.search(rf"\b{r}\b", who)) if "anyone" not in who else OPEN
        for method, path in re.findall(r"`([A-Z]+) ([^`]+)`", routes):
            found = [(m, r) for m, r in ROUTES if m == method and (r == path or (
                path.startswith("...") and r.endswith(path[3:])))]
            assert len(found) == 1, (method, path, found)
            out[found[0]] = roles
    return out


def test_the_documented_route_table_is_the_codes():
    documented = documented_routes()
    assert {k: set(v) for k, v in documented.items()} == {k: set(v) for k, v in ROUTES.items()}


def test_a_trainer_token_reads_pieces_of_its_models_and_an_unscoped_one_of_every_model(kit, tmp_path, tokens):
    path, tok = tokens
    unscoped = add_token(path, TokenSpec("trainer-any", "trainer"))

    async def main():
        async with gateway(kit, tmp_path, path) as (url, s, _):
            await setup(kit, url, s, tok)
            piece = f"{url}/v1/models/{MODEL}/versions/1/full/pieces/0"
            assert (await call(s, "GET", piece, unscoped))[0] == 200
            assert (await call(s, "GET", piece, tok["trainer"]))[0] == 200
            status, body = await call(s, "GET", piece, tok["other_trainer"])
            assert status == 403 and MODEL in body["error"]

    asyncio.run(main())


def test_every_refusal_is_401_or_403_and_changes_nothing(kit, tmp_path, tokens):
    path, tok = tokens
    by_role = {role: tok[role] for role in ROLES}

    async def main():
        async with gateway(kit, tmp_path, path) as (url, s, gw):
            await setup(kit, url, s, tok)
            before = state(gw)
            for (method, route), req in requests(kit).items():
                roles = ROUTES[(method, route)]
                if roles == OPEN:
                    continue
                req = dict(req)
                target = url + req.pop("path")
                for token, expect in [(None, 401), ("dm_" + "x" * 43, 401)] + [
                        (t, 403) for role, t in by_role.items() if role not in roles]:
                    status, body = await call(s, method, target, token, **req)
                    assert status == expect, (method, route, token and token[:6], status, body)
                    assert "error" in body
                if "pool" in roles and ("{name}" in route or route == "/v1/pools"):  # p2 speaking for p1
                    status, body = await call(s, method, target, tok["pool2"], **req)
                    assert status == 403 and "p1" in body["error"], (method, route, body)
                if route == "/v1/gateways":  # gateway B announcing itself as A
                    status, body = await call(s, method, target, tok["gateway2"], **req)
                    assert status == 403 and "'A'" in body["error"], body
                if method == "PUT":  # a trainer of another model
                    status, body = await call(s, method, target, tok["other_trainer"], **req)
                    assert status == 403 and MODEL in body["error"], body
                assert state(gw) == before, (method, route)
            metrics = (await call(s, "GET", f"{url}/metrics", tok["metrics"]))[1]["raw"]
            assert metrics  # readable by the metrics role (its text is checked below)
            text = await (await s.get(f"{url}/metrics", headers=bearer(tok["admin"]))).text()
            assert 'deltamesh_gateway_rejected_requests_total{reason="401"}' in text
            assert 'deltamesh_gateway_rejected_requests_total{reason="403"}' in text

    asyncio.run(main())


def test_each_role_reaches_its_routes(kit, tmp_path, tokens):
    path, tok = tokens

    async def main():
        async with gateway(kit, tmp_path, path) as (url, s, gw):
            await setup(kit, url, s, tok)
            reqs = requests(kit)
            for (method, route), req in reqs.items():
                if method != "GET":
                    continue
                req = dict(req)
                target = url + req.pop("path")
                for role in ROUTES[(method, route)] or ("admin",):
                    status, body = await call(s, method, target, tok[role], **req)
                    if route.endswith("/parts/{part}"):  # let through; v1 full is not whole in this setup
                        assert status == 404 and "whole" in body["error"], (route, role, status, body)
                        continue
                    assert status == 200, (route, role, status, body)
            # Writes, each by its role: a trainer publishes, the pool beats and leaves, a gateway announces.
            for key, role, expect in [(("PUT", "/v1/models/{model}/versions/{version}/{kind}/pieces/{index}"),
                                       "trainer", 201),
                                      (("PUT", "/v1/models/{model}/versions/{version}/{kind}/manifest"), "trainer", 201),
                                      (("PUT", "/v1/models/{model}/statement"), "trainer", 201),
                                      (("PUT", "/v1/models/{model}/staged/{digest}"), "trainer", 201),
                                      (("POST", "/v1/pools/{name}/heartbeat"), "pool", 200),
                                      (("POST", "/v1/gateways"), "gateway", 200),
                                      (("DELETE", "/v1/pools/{name}"), "pool", 200)]:
                req = dict(reqs[key])
                status, body = await call(s, key[0], url + req.pop("path"), tok[role], **req)
                assert status == expect, (key, body)
            assert gw.store.head(MODEL) == 2 and gw.pools.pools() == [] and "A" in gw.downstreams

    asyncio.run(main())


def test_registration_is_checked_field_by_field(kit, tmp_path, tokens):
    path, tok = tokens
    good = {"name": "p1", "model": MODEL, "gpus": 8, "engine": "sglang", "tier": "h100",
            "endpoint": "http://127.0.0.1:9", "version": 3}
    bad = [({"name": "../x"}, "pool name"), ({"model": "a/b"}, "model"), ({"model": 7}, "model"),
           ({"version": -1}, "version"), ({"version": "3"}, "version"), ({"version": 2**60}, "version"),
           ({"gpus": 4097}, "gpus"), ({"gpus": -1}, "gpus"), ({"gpus": "8"}, "gpus"), ({"gpus": True}, "gpus"),
           ({"engine": "e" * 65}, "engine"), ({"tier": "a\nb"}, "tier"), ({"endpoint": "ftp://x"}, "endpoint"),
           ({"endpoint": "http://" + "x" * 300}, "endpoint")]

    async def main():
        async with gateway(kit, tmp_path, path) as (url, s, gw):
            for change, field in bad:
                status, body = await call(s, "POST", f"{url}/v1/pools", tok["pool"], json={**good, **change})
                assert status == 400 and field in body["error"], (change, body)
            for raw in (b"{oops", b"[1]", b"null"):
                status, body = await call(s, "POST", f"{url}/v1/pools", tok["pool"], data=raw,
                                          headers={"Content-Type": "application/json"})
                assert status == 400, (raw, body)
            assert gw.pools.pools() == []
            status, body = await call(s, "POST", f"{url}/v1/pools", tok["pool"], json={**good, "version": None})
            assert status == 201 and body["name"] == "p1"
            beats = [({"version": -2}, "version"), ({"state": "dancing"}, "state"),
                     ({"transfer": {"x": "y" * 5000}}, "transfer"), ({"transfer": [1]}, "transfer")]
            for change, field in beats:
                status, body = await call(s, "POST", f"{url}/v1/pools/p1/heartbeat", tok["pool"],
                                          json={"version": 0, **change})
                assert status == 400 and field in body["error"], (change, body)
            assert gw.pools.get("p1").version is None
            status, body = await call(s, "POST", f"{url}/v1/pools/..%2Fx/heartbeat", tok["pool"], json={})
            assert status in (400, 403, 404)
            status, body = await call(s, "POST", f"{url}/v1/pools/p1/heartbeat", tok["pool"],
                                      json={"version": 0, "state": "idle"})
            assert status == 200 and body == {"name": "p1", "head": None}

    asyncio.run(main())


def test_a_pool_deregisters_itself_and_is_gone(kit, tmp_path, tokens):
    tok = tokens[1]

    async def main():
        async with gateway_with_two_pools(kit, tmp_path, tokens) as (url, s, gw):
            status, body = await call(s, "DELETE", f"{url}/v1/pools/p2", tok["pool"])
            assert status == 403 and "'p2'" in body["error"]
            status, body = await call(s, "DELETE", f"{url}/v1/pools/p1", tok["pool"])
            assert status == 200 and body == {"name": "p1", "deregistered": True}
            status, body = await call(s, "GET", f"{url}/v1/pools", tok["admin"])
            assert [p["name"] for p in body["pools"]] == ["p2"]
            assert not any(link["peer"] == "p1" for link in (await call(s, "GET", f"{url}/v1/links", tok["admin"]))[1]["links"])
            status, body = await call(s, "DELETE", f"{url}/v1/pools/p1", tok["pool"])
            assert status == 404
            status, body = await call(s, "POST", f"{url}/v1/pools/p1/heartbeat", tok["pool"], json={"version": 0})
            assert status == 404 and "register again" in body["error"]
            status, _ = await call(s, "DELETE", f"{url}/v1/pools/p2", tok["admin"])  # an operator clears a pool
            assert status == 200 and gw.pools.pools() == []

    asyncio.run(main())


def test_a_revoked_pool_is_refused_at_its_next_heartbeat_and_others_go_on(kit, tmp_path, tokens):
    path, tok = tokens

    async def main():
        async with gateway_with_two_pools(kit, tmp_path, tokens) as (url, s, gw):
            for _ in range(2):
                for who, name in TWO_POOLS:
                    status, _ = await call(s, "POST", f"{url}/v1/pools/{name}/heartbeat", tok[who], json={"version": 0})
                    assert status == 200
            assert revoke_token(path, "p1") == 1
            seen = gw.pools.get("p1").last_seen
            status, body = await call(s, "POST", f"{url}/v1/pools/p1/heartbeat", tok["pool"], json={"version": 1})
            assert status == 401 and gw.pools.get("p1").version == 0 and gw.pools.get("p1").last_seen == seen
            status, _ = await call(s, "GET", f"{url}/v1/models/{MODEL}/head", tok["pool"])
            assert status == 401  # nor can it read anything
            status, body = await call(s, "POST", f"{url}/v1/pools/p2/heartbeat", tok["pool2"], json={"version": 1})
            assert status == 200 and gw.pools.get("p2").version == 1

    asyncio.run(main())
