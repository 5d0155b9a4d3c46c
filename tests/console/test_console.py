"""`deltamesh console` against a live mini-mesh of real processes (tests/console/conftest.py): what it
shows, that the browser never gets a credential of the mesh, that a console with a login token gives
a browser without a session nothing, that it refuses to listen off loopback without TLS and a login
token, and that a token the mesh refuses is shown as such."""

from __future__ import annotations

import http.client
import json
import os
import ssl
import subprocess
import sys
import urllib.parse
from pathlib import Path

import pytest

from deltamesh.certs import issue, make_ca
from deltamesh.mesh.console.config import ConsoleConfig
from deltamesh.mesh.demo.processes import free_port
from deltamesh.tls import TlsSettings

pytestmark = pytest.mark.slow

DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))


def get(url: str, path: str, *, headers: dict | None = None, context: ssl.SSLContext | None = None,
        method: str = "GET", body: str | None = None) -> tuple[int, dict, bytes]:
    """One request, redirects not followed: (status, headers, body)."""
    parts = urllib.parse.urlsplit(url)
    conn = (http.client.HTTPSConnection(parts.hostname, parts.port, context=context, timeout=10)
            if parts.scheme == "https" else http.client.HTTPConnection(parts.hostname, parts.port, timeout=10))
    try:
        conn.request(method, path, body=body, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, dict(resp.getheaders()), resp.read()
    finally:
        conn.close()


def test_the_console_shows_pools_links_versions_and_the_broker_of_a_live_mesh(mini_mesh):
    console = mini_mesh.start_console()
    try:
        version = mini_mesh.publish()

        def pools_at_version():
            snap = mini_mesh.snapshot()
            pools = {p["name"]: p for p in snap["pools"]}
            return snap if {p["version"] for p in pools.values()} == {version} and len(pools) == 2 else None

        snap = mini_mesh.wait_for(pools_at_version, 30, f"both pools on v{version}")
        pools = {p["name"]: p for p in snap["pools"]}
        assert (pools["pool-us"]["region"], pools["pool-eu"]["region"]) == ("us", "eu")
        assert all(p["state"] == "current" and p["head"] == version and p["status_read"] for p in pools.values())
        relay_link = next(e for e in snap["graph"]["links"] if (e["from"], e["to"]) == ("gateway:us", "gateway:eu"))
        assert relay_link["rtt_p50_ms"] > 0 and relay_link["health"] in ("ok", "slow")
        assert {e["to"] for e in snap["graph"]["links"] if e["kind"] == "pool"} == {"pool:pool-us", "pool:pool-eu"}
        origin = next(g for g in snap["gateways"] if g["origin"])
        assert origin["region"] == "us" and origin["heads"] == {"policy": version} and origin["access"] == "admin"

        def timeline_complete():
            versions = mini_mesh.snapshot()["models"]["policy"]["versions"]
            newest = versions[0] if versions else {}
            return newest if newest.get("version") == version and len(newest["after_s"]) == 4 else None

        newest = mini_mesh.wait_for(timeline_complete, 30, "the version's timeline at both gateways and pools")
        assert newest["after_s"]["gateway:us"] == 0 and newest["after_s"]["gateway:eu"] >= 0
        assert newest["slowest"]["seconds"] >= 0 and newest["everywhere_s"] >= newest["slowest"]["seconds"]
        broker = snap["broker"]
        assert broker["ok"] and "policy" in broker["models"] and broker["balance"]["decision"].startswith("hold")
    finally:
        console.stop()


def test_the_browser_gets_no_token_of_the_mesh_from_any_route(mini_mesh):
    console = mini_mesh.start_console()
    try:
        mini_mesh.wait_for(lambda: mini_mesh.snapshot()["pools"], 30, "a first reading")
        secrets_of_mesh = list(mini_mesh.tokens.values())
        for path in ("/", "/static/console.js", "/static/console.css", "/api/snapshot", "/healthz", "/login",
                     "/static/../config.py", "/nothing"):
            status, headers, body = get(console.url, path)
            seen = body.decode(errors="replace") + json.dumps(headers)
            assert not [t for t in secrets_of_mesh if t in seen], path
        status, _, body = get(console.url, "/static/../config.py")
        assert status == 404 and b"ConsoleConfig" not in body
    finally:
        console.stop()


def test_with_a_login_token_a_browser_without_a_session_gets_nothing(mini_mesh, tmp_path):
    """Over HTTPS with the console's own login token: no page, no script, no data before logging in."""
    ca = make_ca(tmp_path / "ca")
    cert = issue(ca, tmp_path, "console/ops", hosts=["127.0.0.1"], file_stem="console")
    login = tmp_path / "login.token"
    login.write_text("console-login-secret\n")
    login.chmod(0o600)
    port = free_port()
    console = mini_mesh.start("tls-console", [
        "console", "--listen", f"127.0.0.1:{port}", "--gateway", mini_mesh.url("origin"), "--token-file",
        str(mini_mesh.write_token("admin")), "--login-token-file", str(login), "--tls-cert", str(cert.cert),
        "--tls-key", str(cert.key), "--ca", str(ca.cert), "--poll-s", "0.3"])
    console.url = f"https://127.0.0.1:{port}"
    context = ssl.create_default_context(cafile=str(ca.cert))
    try:
        mini_mesh.wait_for(lambda: get(console.url, "/healthz", context=context)[0] == 200, 30, "the console")
        status, headers, body = get(console.url, "/", context=context)
        assert status == 303 and headers["Location"] == "/login" and not body
        for path in ("/api/snapshot", "/static/console.js", "/static/console.css"):
            status, _, body = get(console.url, path, context=context)
            assert status == 401 and b"policy" not in body and mini_mesh.url("origin").encode() not in body, path
        status, _, body = get(console.url, "/api/snapshot", context=context,
                              headers={"Authorization": f"Bearer {mini_mesh.tokens['admin']}"})
        assert status == 401  # the mesh's admin token is not the console's login token
        form = {"Content-Type": "application/x-www-form-urlencoded"}
        status, headers, _ = get(console.url, "/login", context=context, method="POST", headers=form,
                                 body="token=wrong")
        assert status == 401 and "Set-Cookie" not in headers
        status, headers, _ = get(console.url, "/login", context=context, method="POST", headers=form,
                                 body="token=console-login-secret")
        assert status == 303 and headers["Location"] == "/"
        cookie = headers["Set-Cookie"]
        assert "HttpOnly" in cookie and "Secure" in cookie and "SameSite=Strict" in cookie
        session = {"Cookie": cookie.split(";", 1)[0]}
        def snapshot():
            return json.loads(get(console.url, "/api/snapshot", context=context, headers=session)[2])

        snap = mini_mesh.wait_for(lambda: snapshot()["pools"] and snapshot(), 30, "data once logged in")
        assert {p["name"] for p in snap["pools"]} == {"pool-us"}
        status, _, _ = get(console.url, "/api/snapshot", context=context,
                           headers={"Authorization": "Bearer console-login-secret"})
        assert status == 200
    finally:
        console.stop()


@pytest.mark.parametrize("login", ["", "x"], ids=["no-login", "login-but-no-tls"])
def test_it_refuses_to_listen_off_loopback_without_tls_and_a_login_token(login):
    port = free_port()
    env = {**os.environ, "DELTAMESH_CONSOLE_LOGIN_TOKEN": login}
    proc = subprocess.run([DELTAMESH, "console", "--listen", f"0.0.0.0:{port}", "--gateway", "http://127.0.0.1:1"],
                          capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 2, proc.stderr
    assert "not loopback" in proc.stderr and "Traceback" not in proc.stderr


def test_off_loopback_with_tls_and_a_login_token_is_allowed(tmp_path):
    ca = make_ca(tmp_path / "ca")
    cert = issue(ca, tmp_path, "console/ops", hosts=["127.0.0.1"], file_stem="console")
    config = ConsoleConfig(listen="0.0.0.0:8790", gateways=["https://gw:8700"], token="t", login_token="l",
                           tls=TlsSettings(cert=str(cert.cert), key=str(cert.key)))
    assert config.listen == "0.0.0.0:8790"
    with pytest.raises(ValueError, match="not loopback"):
        ConsoleConfig(listen="0.0.0.0:8790", gateways=["https://gw:8700"], login_token="l")


def test_a_token_the_mesh_refuses_is_shown_and_a_metrics_token_shows_the_metrics(mini_mesh):
    refused = mini_mesh.start_console(name="pool-token-console", token="pool-us")
    metrics = mini_mesh.start_console(name="metrics-console", token="metrics")
    try:
        snap = mini_mesh.wait_for(lambda: mini_mesh.snapshot("pool-token-console")["generated_at"]
                                  and mini_mesh.snapshot("pool-token-console"), 30, "a reading")
        assert all("may not read" in g["error"] for g in snap["gateways"]), snap["gateways"]
        assert snap["pools"] == [] and "may not read" in snap["broker"]["error"]

        def read_by_metrics():
            s = mini_mesh.snapshot("metrics-console")
            return s if len(s["pools"]) == 2 and s["gateways"][0]["access"] == "metrics" else None

        snap = mini_mesh.wait_for(read_by_metrics, 30, "pools read from the gateways' metrics")
        assert {p["version"] for p in snap["pools"]} == {mini_mesh.published}
        assert any(e["rtt_p50_ms"] for e in snap["graph"]["links"] if e["kind"] == "relay")
        assert snap["broker"]["ok"] and "balance report" in snap["broker"]["balance_error"]
    finally:
        refused.stop()
        metrics.stop()
