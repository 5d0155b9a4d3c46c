"""A pool's credentials on its weight path: its token (or client certificate) on every request, refused
credentials end it with one clear error before any download, and a clean stop deregisters it.

`deltamesh pool sync` runs as a real process against a real `deltamesh gateway` process with a tokens
file; the mTLS case runs a gateway in this process on a real TLS socket with certificates made here.
"""

from __future__ import annotations

import asyncio
import signal

import pytest

from deltamesh.certs import issue, make_ca
from deltamesh.delta import dir_manifest, read_weights
from deltamesh.gateway_client import GatewayClient
from deltamesh.http import client_session
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weight_sync import CredentialsError, WeightSync
from deltamesh.tls import TlsSettings
from deltamesh.tokens import TokenSpec, add_token
from deltamesh.trainer.publisher import Publisher

MODEL = "tiny"
PIECE = 4096


def _pools(url: str, token: str) -> list[str]:
    async def ask() -> list[str]:
        async with client_session(timeout_s=10) as s:
            answer = await GatewayClient(url, s, token=token).pools()
        return [p["name"] for p in answer["pools"]]
    return asyncio.run(ask())


def test_a_wrong_token_is_refused_before_any_download_and_a_stopped_pool_leaves(kit, spawn_gateway, spawn_pool,
                                                                                 tmp_path):
    tokens = tmp_path / "tokens.toml"
    tok = {who: add_token(tokens, spec) for who, spec in {
        "trainer": TokenSpec("t", "trainer"), "p1": TokenSpec("p1", "pool"), "p2": TokenSpec("p2", "pool"),
        "admin": TokenSpec("ops", "admin")}.items()}
    gw = spawn_gateway("origin", anonymous=False, extra=["--tokens-file", str(tokens)])
    w0 = kit.tiny_weights()
    asyncio.run(Publisher(gw.url, kit.key.key, MODEL, piece_bytes=PIECE, token=tok["trainer"]).publish(w0))

    wrong = spawn_pool("p2", [gw.url], token="dm_" + "x" * 43)
    assert wrong.proc.wait(30) == 4, wrong.log_tail()  # credentials refused (docs/CLI.md)
    errors = [line for line in wrong.log_tail().splitlines() if " E " in line]
    assert len(errors) == 1 and "refused its credentials" in errors[0] and "401" in errors[0], wrong.log_tail()
    assert not wrong.dir.exists() or dir_manifest(wrong.dir) is None
    assert _pools(gw.url, tok["admin"]) == []

    good = spawn_pool("p1", [gw.url], token=tok["p1"], extra=["--model", MODEL])
    kit.wait_until(lambda: dir_manifest(good.dir) is not None, 30, "the pool to sync v0")
    assert kit.same_bits(read_weights(good.dir), w0)
    kit.wait_until(lambda: _pools(gw.url, tok["admin"]) == ["p1"], 10, "p1 to be registered")
    good.stop(signal.SIGTERM)
    assert good.proc.returncode == 143, good.log_tail()  # stopped cleanly by SIGTERM (docs/CLI.md)
    assert _pools(gw.url, tok["admin"]) == [], "a cleanly stopped pool deregisters"


def test_refused_credentials_end_the_loop_with_one_error(kit, tmp_path):
    async def main():
        tokens = tmp_path / "tokens.toml"
        add_token(tokens, TokenSpec("p1", "pool"))
        async with kit.running_gateway(kit.config(tmp_path, tokens_file=str(tokens))) as url:
            config = PoolSyncConfig(gateways=[url], token="dm_wrong", name="p1", dir=str(tmp_path / "pool"),
                                    trusted_keys=[str(kit.key.public)], model=MODEL)
            async with WeightSync(config) as sync:
                with pytest.raises(CredentialsError, match="every gateway refused its credentials .*401"):
                    await asyncio.wait_for(sync.run(asyncio.Event()), 20)

    asyncio.run(main())


def test_a_pool_over_mtls_fetches_bit_exact_and_deregisters_when_stopped(kit, tmp_path):
    ca = make_ca(tmp_path / "ca")
    local = ["127.0.0.1", "localhost"]
    certs = {who: issue(ca, tmp_path, who, hosts=local) for who in ("gateway/origin", "trainer/t", "pool/p1",
                                                                      "admin/ops")}

    def tls(who: str, **kw) -> TlsSettings:
        return TlsSettings(cert=str(certs[who].cert), key=str(certs[who].key), ca=str(ca.cert), **kw)

    async def main():
        config = kit.config(tmp_path, tls=tls("gateway/origin", client_ca=str(ca.cert)))
        async with kit.running_gateway(config) as url:
            assert url.startswith("https://")
            history = [kit.tiny_weights()]
            history.append(kit.next_step(history[0], 1))
            pub = Publisher(url, kit.key.key, MODEL, piece_bytes=PIECE, tls=tls("trainer/t"))
            for w in history:
                await pub.publish(w)
            pool = PoolSyncConfig(gateways=[url], name="p1", dir=str(tmp_path / "pool"), model=MODEL,
                                  trusted_keys=[str(kit.key.public)], tls=tls("pool/p1"), heartbeat_s=0.2)
            stop = asyncio.Event()
            async with WeightSync(pool) as sync, client_session(timeout_s=10, tls=tls("admin/ops")) as admin:
                task = asyncio.create_task(sync.run(stop))
                for _ in range(200):
                    if sync.version == 1:
                        break
                    await asyncio.sleep(0.05)
                assert sync.version == 1 and kit.same_bits(read_weights(tmp_path / "pool"), history[1])
                assert sync.watch.statement is not None and sync.watch.statement.version == 1
                listed = (await GatewayClient(url, admin).pools())["pools"]
                assert [p["name"] for p in listed] == ["p1"]
                stop.set()
                await task
                assert (await GatewayClient(url, admin).pools())["pools"] == []

    asyncio.run(main())


def test_a_pool_token_never_travels_in_clear_text():
    base = {"name": "p", "dir": "d", "trusted_keys": ["k"], "token": "dm_x"}
    with pytest.raises(ValueError, match="refusing to send a token over plain http"):
        PoolSyncConfig(gateways=["http://10.11.12.13:8700"], **base)
    PoolSyncConfig(gateways=["https://10.11.12.13:8700", "http://127.0.0.1:8700"], **base)
    PoolSyncConfig(gateways=["http://10.11.12.13:8700"], tls=TlsSettings(insecure=True), **base)
