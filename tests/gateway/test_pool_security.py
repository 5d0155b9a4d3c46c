"""A pool against a lying relay (TUF's rollback, mix-and-match and freeze attacks, and forged statements).

An honest origin holds v0..v3 (a full snapshot every 2 versions) and the trainer's signed head
statements; the pool's directory holds v2. A relay double (relay_double.py) sits in front of the
origin as the pool's preferred gateway and lies one way per case: an old signed full snapshot offered
as the way to v3, another validly signed full of v2, a head frozen at v2 (seen against the origin's
head, or against the signed statement), an old statement, a forged one. Each time the pool refuses,
its directory stays at v2 bit-exact, it says why (refusals by reason, the gateway's standing, one log
line naming the gateway), and it reaches v3 through the honest origin. A rollout pool's weight stream
reports the same through its status and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from pathlib import Path

import deltamesh_test_relay_double as relay_double  # a helper module of this folder, loaded by its conftest.py
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from deltamesh.delta import encode_full, generate_key, read_weights, sign_statement
from deltamesh.http import client_session, request_json
from deltamesh.mesh.pool.head_check import Refusal
from deltamesh.mesh.pool.metrics import PoolMetrics
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weight_sync import Refused, WeightSync
from deltamesh.mesh.pool.weights import PolicyWeights
from deltamesh.trainer.publisher import Publisher

MODEL = "tiny"
PIECE = 4096


def _config(kit, tmp_path: Path, gateways: list[str], **kw) -> PoolSyncConfig:
    kw.setdefault("stall_timeout_s", 2.0)
    kw.setdefault("give_up_s", 10.0)
    kw.setdefault("poll_wait_s", 0.5)
    kw.setdefault("stale_after_s", 1.0)
    return PoolSyncConfig(gateways=gateways, token="region-token-1", name="p", dir=str(tmp_path / "pool"),
                          trusted_keys=[str(kit.key.public)], model=MODEL, heartbeat_s=0.3, **kw)


@dataclass
class Mesh:
    honest: str
    double: object
    weights: list
    steps: dict = field(default_factory=dict)
    """(version, kind) -> the plan step of it at the honest gateway."""


@contextlib.asynccontextmanager
async def mesh(kit, tmp_path: Path):
    """The honest origin with v0..v3, the pool's directory at v2, and the relay double in front of it."""
    async with kit.running_gateway(kit.config(tmp_path / "honest")) as honest:
        pub = Publisher(honest, kit.key.key, MODEL, full_every=2, piece_bytes=PIECE)
        w = [kit.tiny_weights()]
        for v in (1, 2, 3):
            w.append(kit.next_step(w[-1], v))
        for x in w[:3]:
            await pub.publish(x)
        async with WeightSync(_config(kit, tmp_path, [honest])) as sync:
            assert await sync.sync_once() and sync.version == 2
        await pub.publish(w[3])
        async with client_session(timeout_s=10) as s:
            listing = await request_json(s, "GET", f"{honest}/v1/models/{MODEL}/versions")
        steps = {(e["version"], e["kind"]): e for e in listing["versions"]}
        async with relay_double.RelayDouble(honest).serving() as double:
            yield Mesh(honest, double, w, steps)


def _plan(steps: list[dict], to: int) -> dict:
    steps = [{k: e[k] for k in ("version", "kind", "base_version", "payload_bytes", "pieces")} for e in steps]
    return {"model": MODEL, "from": 2, "to": to, "reason": "delta chain", "steps": steps,
            "payload_bytes": sum(s["payload_bytes"] for s in steps)}


def _lie(case: str, m: Mesh, kit) -> dict:
    """Make the double lie as `case` says; returns the pool's settings for it."""
    d = m.double
    if case == "rollback":  # v3 announced, and the old signed full v0 offered as the way there
        d.head, d.plan = 3, _plan([m.steps[(0, "full")]], 3)
    elif case == "equivocation":  # another validly signed full of v2, the version the pool holds
        evil = encode_full(kit.tiny_weights(7), model_id=MODEL, version=2, key=kit.key.key, piece_bytes=PIECE)
        d.versions[(2, "full")] = (evil.manifest_bytes, list(evil.pieces))
        d.head = 3
        d.plan = _plan([{"version": 2, "kind": "full", "base_version": None, "pieces": len(evil.pieces),
                         "payload_bytes": evil.manifest.payload_bytes}], 3)
    elif case == "freeze_head":  # frozen at v2 while the origin (another of the pool's gateways) has v3
        d.head, d.statement = 2, None
    elif case == "old_statement":  # frozen, and serving a validly signed statement from an hour ago
        d.head = 2
        d.statement = sign_statement(kit.key.key, MODEL, 2, m.steps[(2, "full")]["weights_hash"],
                                     int((time.time() - 3600) * 1000))
        return {"statement_max_age_s": 60.0, "stale_after_s": 0.0}
    elif case == "forged_statement":
        d.statement = sign_statement(generate_key(), MODEL, 9, "0" * 32)
    elif case == "other_model_statement":
        d.statement = sign_statement(kit.key.key, "other", 9, "0" * 32)
    return {}


async def _run_until(runner: WeightSync | PolicyWeights, version: int) -> None:
    """Run a weight stream until it holds `version` or its loop ends (15 s at most), then stop it."""
    stop = asyncio.Event()
    task = asyncio.create_task(runner.run(stop))
    for _ in range(300):
        if runner.version == version or task.done():
            break
        await asyncio.sleep(0.05)
    stop.set()
    await task


REASON = {"rollback": "rollback", "equivocation": "equivocation", "freeze_head": "stale", "old_statement": "stale",
          "forged_statement": "statement", "other_model_statement": "statement"}


@pytest.mark.parametrize("case", list(REASON))
def test_a_lying_relay_is_refused_and_the_pool_moves_on_through_the_honest_gateway(kit, tmp_path, case, caplog):
    async def main():
        async with mesh(kit, tmp_path) as m:
            refusals: list[Refusal] = []
            at_refusal = []

            def refused(r: Refusal) -> None:
                refusals.append(r)
                at_refusal.append(kit.same_bits(read_weights(tmp_path / "pool"), m.weights[2]))

            config = _config(kit, tmp_path, [m.double.url, m.honest], **_lie(case, m, kit))
            async with WeightSync(config, on_refusal=refused) as sync:
                assert sync.version == 2 and sync.guard.held == 2
                await _run_until(sync, 3)
                assert sync.version == 3, (refusals, sync.last_error)
                assert kit.same_bits(read_weights(tmp_path / "pool"), m.weights[3])
                reason = REASON[case]
                assert refusals and refusals[0].reason == reason and refusals[0].gateway == m.double.url
                assert at_refusal[0], "the directory held v2 bit-exact when the lie was refused"
                assert sync.book.refusals[reason] >= 1
                standing = sync.book.describe()[m.double.url]
                assert standing["state"] == ("stale" if reason == "stale" else "refused"), standing
                assert sync.book.describe()[m.honest]["state"] == "ok"
                assert m.double.served, "the double told its lie"
            lines = [r.getMessage() for r in caplog.records if m.double.url in r.getMessage()
                     and (" refused " in r.getMessage() or "is stale" in r.getMessage())]
            assert len(lines) == 1, lines
            if case == "rollback":
                assert "v0 full" in lines[0] and "holds v2" in lines[0]

    asyncio.run(main())


def test_a_statement_newer_than_the_only_gateway_s_head_flags_it_stale(kit, tmp_path):
    """One gateway, frozen at v2, passing on the trainer's signed statement of v3: after the bound the
    pool flags it stale (there is nothing to turn to), and stays where it is."""
    async def main():
        async with mesh(kit, tmp_path) as m:
            m.double.head = 2
            refusals: list[Refusal] = []
            async with WeightSync(_config(kit, tmp_path, [m.double.url]), on_refusal=refusals.append) as sync:
                deadline = time.monotonic() + 10
                while not refusals and time.monotonic() < deadline:
                    assert await sync.sync_once(wait_s=0.3) is False
                assert [r.reason for r in refusals] == ["stale"] and "below v3" in refusals[0].offered
                assert sync.watch.statement.version == 3 and sync.version == 2
                assert sync.book.describe()[m.double.url]["state"] == "stale"
                m.double.head = None  # it catches up: the flag goes, and v3 comes
                assert await sync.sync_once() is True and sync.version == 3
                assert sync.book.describe()[m.double.url]["state"] == "ok"

    asyncio.run(main())


def test_a_rollback_plan_is_refused_before_any_download(kit, tmp_path):
    async def main():
        async with mesh(kit, tmp_path) as m:
            _lie("rollback", m, kit)
            async with WeightSync(_config(kit, tmp_path, [m.double.url, m.honest])) as sync:
                assert await sync.wait_for_head() == 3
                with pytest.raises(Refused, match="rollback"):
                    await sync.fetch_plan(3)
                assert not [p for p in m.double.served if "/versions/" in p]
                assert sync.version == 2 and "v0 full" in sync.last_error and m.double.url in sync.last_error

    asyncio.run(main())


class DirEngine:
    """An engine that only loads versions from the synced directory (as SGLang does), for the weight stream."""

    model_id = MODEL
    supports_in_place = False

    def __init__(self) -> None:
        self.version = -1

    async def load_version(self, path, version: int) -> None:
        read_weights(path)
        self.version = version


def test_a_rollout_pool_reports_refusals_in_status_and_metrics(kit, tmp_path):
    async def main():
        async with mesh(kit, tmp_path) as m:
            _lie("rollback", m, kit)
            metrics = PoolMetrics(CollectorRegistry())
            weights = PolicyWeights(DirEngine(), _config(kit, tmp_path, [m.double.url, m.honest]), metrics=metrics)
            await _run_until(weights, 3)
            assert weights.version == 3
            text = generate_latest(metrics.registry).decode()
            assert f'deltamesh_pool_gateway_refusals_total{{model="{MODEL}",reason="rollback"}} 1.0' in text
            assert f'deltamesh_pool_gateway_stale{{gateway="{m.double.url}",model="{MODEL}"}} 0.0' in text
            assert weights.sync.book.describe()[m.double.url]["state"] == "refused"
            assert "rollback" in weights.status.last_error and m.double.url in weights.status.last_error

    asyncio.run(main())
