"""Broker authentication against a real broker on loopback (TLS where it says so), with real tokens files.

Every route without a token, with a wrong-role token and with another pool's token is refused (401/403)
and changes nothing; a token revoked while pools run is refused at its next call while the others go
on; the broker serves HTTPS with mTLS, and clients never send a token in clear text to a remote host.
"""

from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import aiohttp
import pytest

from deltamesh.auth import Policy, unlisted_routes
from deltamesh.broker_client import BrokerClient
from deltamesh.certs import issue, make_ca
from deltamesh.http import HttpError, serving
from deltamesh.mesh.broker.config import BrokerConfig, TasksConfig
from deltamesh.mesh.broker.server import ROUTES, SLOT_KEY, build_app
from deltamesh.tls import TlsError, TlsSettings, server_context
from deltamesh.tokens import TokenSpec, add_token, revoke_token
from deltamesh.trainer.batch_client import BatchClient

# (method, path, JSON body) of every route, as a caller would use it
CALLS = [
    ("POST", "/v1/trajectories", {"trajectories": []}),
    ("POST", "/v1/leases", {"pool": "eu-1"}),
    ("GET", "/v1/leases", None),
    ("POST", "/v1/models/m/version", {"version": 5}),
    ("POST", "/v1/models/m/steps", {"wait_s": 1.0, "step_s": 2.0}),
    ("POST", "/v1/models/m/batch", {"size": 1, "timeout_s": 0}),
    ("POST", "/v1/models/m/acks", {"batch_ids": ["b"]}),
    ("GET", "/v1/status", None),
    ("GET", "/v1/balance", None),
    ("GET", "/metrics", None),
]
# who may make each call above
ALLOWED = {
    "/v1/trajectories": {"pool"}, "POST /v1/leases": {"pool"}, "GET /v1/leases": {"pool", "admin"},
    "/v1/models/m/version": {"trainer"}, "/v1/models/m/steps": {"trainer"}, "/v1/models/m/batch": {"trainer"},
    "/v1/models/m/acks": {"trainer"}, "/v1/status": {"pool", "trainer", "admin", "metrics"},
    "/v1/balance": {"admin"}, "/metrics": {"metrics", "admin"},
}


def allowed(method: str, path: str) -> set[str]:
    return ALLOWED.get(f"{method} {path}", ALLOWED.get(path, set()))


@pytest.fixture
def tokens(tmp_path):
    path = tmp_path / "tokens.toml"
    return path, {
        "pool": add_token(path, TokenSpec("eu-1", "pool", ["m"])),
        "other_pool": add_token(path, TokenSpec("eu-2", "pool", ["m"])),
        "trainer": add_token(path, TokenSpec("m-trainer", "trainer", ["m"])),
        "other_trainer": add_token(path, TokenSpec("x-trainer", "trainer", ["x"])),
        "admin": add_token(path, TokenSpec("ops", "admin")),
        "metrics": add_token(path, TokenSpec("prometheus", "metrics")),
    }


@asynccontextmanager
async def broker(tmp_path, tokens_file, *, tls: TlsSettings | None = None, dataset=None):
    config = BrokerConfig(models=["m"], tokens_file=str(tokens_file), durability="process",
                          tasks=TasksConfig(dataset=str(dataset)) if dataset else TasksConfig())
    app = build_app(config, tmp_path / "broker.db")
    async with serving(app, "127.0.0.1:0", ssl_context=server_context(tls) if tls else None) as url:
        yield url, app[SLOT_KEY].broker


async def raw_call(url: str, method: str, path: str, body, token: str | None) -> int:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as s:
        async with s.request(method, f"{url}{path}", json=body, headers=headers) as r:
            return r.status


def test_every_route_has_a_decision():
    app = build_app(BrokerConfig(models=["m"], anonymous=True), ":memory:")
    assert unlisted_routes(app, Policy(ROUTES)) == []


def test_a_broker_without_tokens_must_say_it_is_anonymous(tmp_path):
    with pytest.raises(ValueError, match="needs a tokens file"):
        build_app(BrokerConfig(models=["m"]), tmp_path / "b.db")


def test_callers_without_the_right_credential_are_refused_and_change_nothing(tmp_path, tokens):
    path, tok = tokens

    async def scenario():
        async with broker(tmp_path, path) as (url, b):
            before = (b.status(), b.leases())
            for method, route, body in CALLS:
                assert await raw_call(url, method, route, body, None) == 401, route
                assert await raw_call(url, method, route, body, "dm_forged") == 401, route
                for role, token in (("pool", tok["pool"]), ("trainer", tok["trainer"]), ("admin", tok["admin"]),
                                    ("metrics", tok["metrics"])):
                    if role not in allowed(method, route):
                        assert await raw_call(url, method, route, body, token) == 403, (role, route)
            # in scope by role, out of scope by name or model
            assert await raw_call(url, "POST", "/v1/leases", {"pool": "eu-1"}, tok["other_pool"]) == 403
            assert await raw_call(url, "POST", "/v1/models/m/version", {"version": 9}, tok["other_trainer"]) == 403
            assert (b.status(), b.leases()) == before
            assert b.models["m"].version == 0

    asyncio.run(scenario())


def test_a_pool_submits_only_as_itself(tmp_path, tokens, make_group):
    path, tok = tokens

    async def scenario():
        async with broker(tmp_path, path) as (url, b):
            group = make_group("g", [1.0, 0.0])
            for t in group:
                t.pool = "eu-1"
            async with BrokerClient(url, token=tok["other_pool"], pool="eu-2") as impostor:
                with pytest.raises(HttpError) as e:
                    await impostor.submit(group)
                assert e.value.status == 403 and "may not submit for pool 'eu-1'" in e.value.reason
            assert b.models["m"].fresh_samples == 0
            async with BrokerClient(url, token=tok["pool"], pool="eu-1") as pool:
                assert (await pool.submit(group)).accepted == 2
            assert b.models["m"].fresh_samples == 2

    asyncio.run(scenario())


def test_a_revoked_token_is_refused_at_its_next_call_while_others_go_on(tmp_path, tokens, make_group):
    path, tok = tokens

    def unnamed(group):  # named by the broker after the caller
        for t in group:
            t.pool = ""
        return group

    async def scenario():
        async with broker(tmp_path, path) as (url, b), \
                BrokerClient(url, token=tok["pool"], pool="eu-1") as first, \
                BrokerClient(url, token=tok["other_pool"], pool="eu-2") as second:
            assert (await first.status())["models"]["m"]["version"] == 0
            revoke_token(path, "eu-1")
            with pytest.raises(HttpError) as e:
                await first.submit(unnamed(make_group("g1", [1.0])))
            assert e.value.status == 401
            assert (await second.submit(unnamed(make_group("g2", [1.0])))).accepted == 1
            assert b.models["m"].fresh_samples == 1

    asyncio.run(scenario())


def test_trainer_and_admin_roles_over_mtls(tmp_path, tokens):
    path, tok = tokens
    ca = make_ca(tmp_path / "ca")
    server = issue(ca, tmp_path, "broker/main", hosts=["127.0.0.1"])
    client = issue(ca, tmp_path, "trainer/m-trainer")
    server_tls = TlsSettings(cert=str(server.cert), key=str(server.key), client_ca=str(ca.cert))
    client_tls = TlsSettings(cert=str(client.cert), key=str(client.key), ca=str(ca.cert))

    async def scenario():
        async with broker(tmp_path, path, tls=server_tls) as (url, b):
            assert url.startswith("https://")
            async with BatchClient(url, "m", token=tok["trainer"], tls=client_tls) as trainer:
                await trainer.report_version(3)
                assert await trainer.next_batch(1, timeout_s=0) is None
            async with BrokerClient(url, token=tok["admin"], tls=client_tls) as admin:
                assert "models" in await admin.balance()
            # failover_s=0: a refused handshake looks like a lost connection, which the client would retry
            async with BrokerClient(url, tls=TlsSettings(ca=str(ca.cert)), token=tok["admin"], failover_s=0) as no_cert:
                with pytest.raises(HttpError) as e:
                    await no_cert.status()
                assert "client certificate" in str(e.value)
            assert b.models["m"].version == 3

    asyncio.run(scenario())


def test_metrics_need_the_metrics_role(tmp_path, tokens):
    path, tok = tokens

    async def scenario():
        async with broker(tmp_path, path) as (url, _):
            async with aiohttp.ClientSession() as s:
                async with s.get(f"{url}/metrics", headers={"Authorization": f"Bearer {tok['metrics']}"}) as r:
                    assert r.status == 200 and "deltamesh_broker" in await r.text()
                async with s.get(f"{url}/healthz") as r:
                    assert r.status == 200 and json.loads(await r.text()) == {"ok": True, "role": "active"}

    asyncio.run(scenario())


def test_tokens_never_travel_in_clear_text_to_a_remote_broker():
    with pytest.raises(TlsError, match="refusing to send a token"):
        BrokerClient("http://broker.example:8800", token="dm_x")
