"""TLS on the weight network, over real sockets with certificates made here (deltamesh.certs).

An mTLS origin and an mTLS relay run as real `deltamesh gateway` processes: the trainer publishes
with its client certificate, the relay pulls with its gateway certificate (and announces itself,
so the origin probes it over TLS), and a pool with its own certificate fetches a plan through the
relay and ends bit-exact. Every wrong combination (another CA, an expired or misnamed server
certificate, no or an expired client certificate, plain http against TLS) is refused with one clear
error line and stores nothing.
"""

from __future__ import annotations

import asyncio
import datetime
import subprocess
import sys
from pathlib import Path

import pytest

from deltamesh.certs import issue, make_ca
from deltamesh.delta import apply_to_dir, load_manifest, read_weights
from deltamesh.gateway.server.app import GATEWAY_KEY, create_app, ssl_context
from deltamesh.gateway_client import GatewayClient
from deltamesh.http import HttpError, client_session, request_bytes, serving
from deltamesh.tls import TlsSettings, client_context
from deltamesh.trainer.publisher import Publisher

DELTAMESH = [str(Path(sys.executable).with_name("deltamesh"))]
MODEL = "tiny-1"
PIECE = 4096


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pki")
    ca = make_ca(root / "ca")
    stranger = make_ca(root / "stranger", name="someone else's CA")
    old = datetime.datetime(2020, 1, 1, tzinfo=datetime.timezone.utc)
    local = ["127.0.0.1", "localhost"]
    return {
        "ca": ca, "stranger_ca": stranger,
        "origin": issue(ca, root, "gateway/origin", hosts=local),
        "relay": issue(ca, root, "gateway/A", hosts=local),
        "trainer": issue(ca, root, "trainer/t"),
        "pool": issue(ca, root, "pool/p1"),
        "admin": issue(ca, root, "admin/ops"),
        "stranger": issue(stranger, root, "trainer/mallory"),
        "expired_server": issue(ca, root, "gateway/old", hosts=local, not_before=old, days=30),
        "expired_client": issue(ca, root, "trainer/old", not_before=old, days=30, file_stem="trainer-old"),
        "misnamed": issue(ca, root, "gateway/elsewhere", hosts=["elsewhere.example"]),
    }


def tls(pki, cert: str | None = None, *, ca: str = "ca", client_ca: bool = False) -> TlsSettings:
    return TlsSettings(cert=str(pki[cert].cert) if cert else "", key=str(pki[cert].key) if cert else "",
                       ca=str(pki[ca].cert), client_ca=str(pki["ca"].cert) if client_ca else "")


def tls_flags(pki, cert: str) -> list[str]:
    return ["--tls-cert", str(pki[cert].cert), "--tls-key", str(pki[cert].key), "--ca", str(pki["ca"].cert),
            "--client-ca", str(pki["ca"].cert)]


async def pool_sync(base: str, settings: TlsSettings, keys, directory: Path) -> int:
    """What a pool does with a plan: verified manifests and pieces over its mTLS session, applied to a
    directory atomically; returns the version the directory holds."""
    async with client_session(tls=settings, timeout_s=30) as s:
        gateway = GatewayClient(base, s, peer="pool/p1")
        await gateway.register_pool({"name": "p1", "model": MODEL, "gpus": 1})
        plan = await gateway.plan(MODEL, {})
        steps = []
        for step in plan["steps"]:
            url = gateway.version_url(MODEL, step["version"], step["kind"])
            manifest = load_manifest(await request_bytes(s, "GET", f"{url}/manifest", params={"wait": 10}), keys)
            pieces = [await request_bytes(s, "GET", f"{url}/pieces/{i}", params={"wait": 10})
                      for i in range(len(manifest.pieces))]
            steps.append((manifest, pieces))
        final = await asyncio.to_thread(apply_to_dir, directory, steps)
        await gateway.heartbeat("p1", {"version": final.version, "state": "idle"})
        return final.version


def test_mtls_origin_relay_chain_pool_bit_exact(kit, pki, spawn_gateway, tmp_path):
    health = client_context(tls(pki, "admin"))
    origin = spawn_gateway("origin", anonymous=False, https=True, health=health, start=False,
                           extra=tls_flags(pki, "origin"))
    origin.wait()
    relay = spawn_gateway("A", upstreams=[origin.url], anonymous=False, https=True, health=health,
                          extra=tls_flags(pki, "relay"))
    history = [kit.tiny_weights()]
    for v in (1, 2):
        history.append(kit.next_step(history[-1], v))

    async def main():
        pub = Publisher(origin.url, kit.key.key, MODEL, piece_bytes=PIECE, tls=tls(pki, "trainer"))
        for w in history:
            await pub.publish(w)
        keys = [kit.key.key.public_key()]
        for _ in range(100):  # the relay follows the origin's head
            async with client_session(tls=tls(pki, "pool"), timeout_s=10) as s:
                if await GatewayClient(relay.url, s).head(MODEL) == 2:
                    break
            await asyncio.sleep(0.1)
        version = await pool_sync(relay.url, tls(pki, "pool"), keys, tmp_path / "pool")
        assert version == 2 and kit.same_bits(read_weights(tmp_path / "pool"), history[2])
        async with client_session(tls=tls(pki, "admin"), timeout_s=10) as s:
            for _ in range(100):  # A announced itself with its certificate: the origin probes it over TLS
                links = (await GatewayClient(origin.url, s).links())["links"]
                down = [link for link in links if link["role"] == "downstream"]
                if down and down[0]["rtt_ms"]["samples"]:
                    break
                await asyncio.sleep(0.1)
            assert down[0]["peer"] == "A" and down[0]["url"] == relay.url and down[0]["rtt_ms"]["samples"] > 0
            pools = (await GatewayClient(relay.url, s).pools())["pools"]
            assert [(p["name"], p["version"]) for p in pools] == [("p1", 2)]

    asyncio.run(main())
    # The CLI speaks TLS the same way: an admin certificate lists the relay's pools; another CA is refused.
    admin = ["--ca", str(pki["ca"].cert), "--tls-cert", str(pki["admin"].cert), "--tls-key", str(pki["admin"].key)]
    ok = subprocess.run([*DELTAMESH, "pools", "--gateway", relay.url, "--json", *admin],
                        capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0 and '"p1"' in ok.stdout, ok.stderr
    wrong = ["--ca", str(pki["stranger_ca"].cert), *admin[2:]]
    refused = subprocess.run([*DELTAMESH, "pools", "--gateway", relay.url, *wrong],
                             capture_output=True, text=True, timeout=60)
    assert refused.returncode == 3 and "CERTIFICATE_VERIFY_FAILED" in refused.stderr  # docs/CLI.md
    assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr


@pytest.mark.parametrize("case", ["wrong_ca", "expired_server", "misnamed_server", "no_client_cert",
                                  "expired_client_cert", "stranger_client_cert", "plain_http"])
def test_bad_tls_is_refused_clearly_and_stores_nothing(kit, pki, tmp_path, case):
    server_cert = {"expired_server": "expired_server", "misnamed_server": "misnamed"}.get(case, "origin")
    client = {"wrong_ca": tls(pki, "trainer", ca="stranger_ca"), "no_client_cert": tls(pki),
              "expired_client_cert": tls(pki, "expired_client"), "stranger_client_cert": tls(pki, "stranger")
              }.get(case, tls(pki, "trainer"))
    reason = {"wrong_ca": "CERTIFICATE_VERIFY_FAILED", "expired_server": "certificate has expired",
              "misnamed_server": "IP address mismatch", "no_client_cert": "client certificate",
              "expired_client_cert": "client certificate", "stranger_client_cert": "client certificate",
              "plain_http": "use https://"}[case]

    async def main():
        config = kit.config(tmp_path, tls=tls(pki, server_cert, client_ca=True))
        app = create_app(config)
        async with serving(app, "127.0.0.1:0", ssl_context=ssl_context(config)) as url:
            if case == "plain_http":
                url = url.replace("https://", "http://")
            pub = Publisher(url, kit.key.key, MODEL, piece_bytes=PIECE, tls=client)
            with pytest.raises(HttpError) as refused:
                await pub.publish(kit.tiny_weights(), version=0)
            message = str(refused.value)
            assert refused.value.status == 0 and "\n" not in message and reason in message, message
            assert app[GATEWAY_KEY].store.models() == [] and app[GATEWAY_KEY].store.epoch == 0

    asyncio.run(main())


def test_a_relay_that_cannot_verify_its_upstream_stores_nothing(kit, pki, tmp_path):
    async def main():
        origin_cfg = kit.config(tmp_path / "o", tls=tls(pki, "origin", client_ca=True))
        origin_app = create_app(origin_cfg)
        async with serving(origin_app, "127.0.0.1:0", ssl_context=ssl_context(origin_cfg)) as origin:
            await Publisher(origin, kit.key.key, MODEL, piece_bytes=PIECE,
                            tls=tls(pki, "trainer")).publish(kit.tiny_weights())
            relay_cfg = kit.config(tmp_path / "r", region="A", upstreams=[origin],
                                   tls=tls(pki, "relay", ca="stranger_ca"))
            relay_app = create_app(relay_cfg)
            async with serving(relay_app, "127.0.0.1:0"):
                gw = relay_app[GATEWAY_KEY]
                for _ in range(50):
                    link = gw.links.find(origin, "upstream")
                    if link is not None and link.last_error:
                        break
                    await asyncio.sleep(0.1)
                assert "CERTIFICATE_VERIFY_FAILED" in link.last_error and "\n" not in link.last_error
                await asyncio.sleep(0.5)
                assert gw.store.models() == [] and origin_app[GATEWAY_KEY].downstreams.expire() == []
                assert len(origin_app[GATEWAY_KEY].downstreams) == 0

    asyncio.run(main())
