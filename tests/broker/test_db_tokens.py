"""Broker tokens in a real PostgreSQL database, managed with `deltamesh tokens --db` (once as its own
process, as an operator runs it; else its parsed command in this process, to keep the test quick).

Two token stores on one database stand for two brokers (active and standby): a token added there
authenticates on both, and once revoked both refuse it within about a second; a token of the wrong
role is refused; a database role that may not write the tokens table is refused and changes nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from aiohttp import web

from deltamesh.auth import Policy, auth_middleware
from deltamesh.http import HttpError, bearer, client_session, request_json, serving
from deltamesh.mesh.broker.auth_tokens import broker_token_store
from deltamesh.mesh.broker.config import BrokerConfig
from deltamesh.mesh.broker.postgres_schema import migrate
from deltamesh.mesh.broker.server import ROUTES
from deltamesh.mesh.cli import build_parser
from deltamesh.tokens import TokenStore

DELTAMESH = [str(Path(sys.executable).with_name("deltamesh"))]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*DELTAMESH, "tokens", *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def tokens(capsys: pytest.CaptureFixture, caplog: pytest.LogCaptureFixture):
    """`tokens(*args)`: run `deltamesh tokens ARGS` in this process; (exit code, stdout, logged errors)."""
    parser = build_parser()
    caplog.set_level(logging.ERROR, logger="deltamesh.mesh.cli")

    def run(*argv: str) -> tuple[int, str, str]:
        caplog.clear()
        try:
            args: argparse.Namespace = parser.parse_args(["tokens", *argv])
        except SystemExit as e:
            captured = capsys.readouterr()
            return int(e.code), captured.out, captured.err
        code = args.run(args)
        return code, capsys.readouterr().out.strip(), caplog.text

    return run


def rows(dsn: str) -> tuple[int, int]:
    """(tokens stored, broker_tokens_version)."""
    with psycopg.connect(dsn) as conn:
        count = conn.execute("SELECT count(*) FROM broker_tokens").fetchone()[0]
        return count, conn.execute("SELECT version FROM broker_tokens_version").fetchone()[0]


def refused_by_all(stores: list[TokenStore], token: str, within_s: float) -> float:
    """Seconds until every store refuses `token`; fails after `within_s`."""
    began = time.monotonic()
    while any(store.authenticate(token) is not None for store in stores):
        assert time.monotonic() - began < within_s, "a revoked token is still accepted"
        time.sleep(0.05)
    return time.monotonic() - began


def test_a_token_added_and_revoked_in_the_database_holds_on_every_broker(postgres_dsn, tokens):
    added = cli("add", "--db", postgres_dsn, "--name", "eu-1", "--role", "pool", "--model", "policy")
    assert added.returncode == 0, added.stderr  # on a database no broker has started on: tables made
    token = added.stdout.strip()
    assert token.startswith("dm_")
    config = BrokerConfig(db=postgres_dsn)
    replicas = [broker_token_store(config), broker_token_store(config)]
    try:
        for store in replicas:
            who = store.authenticate(token)
            assert (who.name, who.role, who.models) == ("eu-1", "pool", ("policy",))
        late = tokens("add", "--db", postgres_dsn, "--name", "t", "--role", "trainer")[1]
        began = time.monotonic()
        while any(store.authenticate(late) is None for store in replicas):  # picked up without a restart
            assert time.monotonic() - began < 2.0
            time.sleep(0.05)
        code, listed, _ = tokens("list", "--db", postgres_dsn)
        assert code == 0 and "eu-1" in listed and "policy" in listed and token not in listed
        assert token not in str(rows(postgres_dsn)) and rows(postgres_dsn) == (2, 2)

        assert tokens("revoke", "--db", postgres_dsn, "--name", "eu-1")[:2] == (0, "revoked 1 token(s) of eu-1")
        assert refused_by_all(replicas, token, within_s=2.0) < 2.0
        assert all(store.authenticate(late).name == "t" for store in replicas)
        code, _, errors = tokens("revoke", "--db", postgres_dsn, "--name", "eu-1")
        assert code == 1 and "holds no token of eu-1" in errors
        assert rows(postgres_dsn) == (1, 3)
    finally:
        for store in replicas:
            store.close()


def test_a_database_token_of_the_wrong_role_is_refused(postgres_dsn, tokens):
    trainer = tokens("add", "--db", postgres_dsn, "--name", "t", "--role", "trainer")[1]
    pool = tokens("add", "--db", postgres_dsn, "--name", "eu-1", "--role", "pool")[1]
    store = broker_token_store(BrokerConfig(db=postgres_dsn))
    changed: list[str] = []

    async def lease(request: web.Request) -> web.Response:
        changed.append("leased")
        return web.json_response({"leases": []})

    app = web.Application(middlewares=[auth_middleware(Policy(ROUTES, store))])
    app.router.add_post("/v1/leases", lease)

    async def scenario() -> None:
        async with serving(app, "127.0.0.1:0") as url, client_session(timeout_s=10) as s:
            for token, status in ((trainer, 403), ("dm_" + secrets.token_urlsafe(32), 401)):
                with pytest.raises(HttpError) as refused:
                    await request_json(s, "POST", f"{url}/v1/leases", body={}, headers=bearer(token))
                assert refused.value.status == status
            assert changed == []
            assert await request_json(s, "POST", f"{url}/v1/leases", body={}, headers=bearer(pool)) == {"leases": []}
            assert changed == ["leased"]

    try:
        asyncio.run(scenario())
    finally:
        store.close()


def test_a_database_role_that_may_not_write_the_tokens_is_refused_with_nothing_changed(postgres_dsn, tokens):
    migrate(postgres_dsn)
    assert tokens("add", "--db", postgres_dsn, "--name", "eu-1", "--role", "pool")[0] == 0
    role = f"nobody_{secrets.token_hex(4)}"
    with psycopg.connect(postgres_dsn, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}" LOGIN')
    outsider = postgres_dsn.replace("postgres@", f"{role}@", 1)
    try:
        before = rows(postgres_dsn)
        code, out, errors = tokens("add", "--db", outsider, "--name", "intruder", "--role", "admin")
        assert code == 1 and "permission denied" in errors and "dm_" not in out
        code, _, errors = tokens("revoke", "--db", outsider, "--name", "eu-1")
        assert code == 1 and "permission denied" in errors
        assert rows(postgres_dsn) == before
    finally:
        with psycopg.connect(postgres_dsn, autocommit=True) as conn:
            conn.execute(f'DROP ROLE "{role}"')


def test_the_tokens_command_takes_a_file_or_a_database_not_both(tmp_path, postgres_dsn, tokens):
    code, _, errors = tokens("add", "--file", str(tmp_path / "t.toml"), "--db", postgres_dsn, "--name", "a",
                             "--role", "pool")
    assert code == 2 and "not allowed with argument" in errors
    code, _, errors = tokens("revoke", "--name", "a")
    assert code == 2 and "one of the arguments --file --db is required" in errors
    assert not (tmp_path / "t.toml").exists()


def test_a_broker_without_a_tokens_file_needs_a_database_or_anonymous(tmp_path):
    with pytest.raises(ValueError, match="needs a tokens file"):
        broker_token_store(BrokerConfig(db=str(tmp_path / "broker.db")))
    assert broker_token_store(BrokerConfig(db=str(tmp_path / "broker.db"), anonymous=True)).identities() == []
