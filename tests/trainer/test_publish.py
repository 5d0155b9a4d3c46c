"""The trainer's side of the weight stream: `start_stream` and the loop's publishing mesh client.

`start_stream` runs against a real gateway served in this process on a loopback socket, one test per
state a restarted trainer can find the gateway in (empty, at its checkpoint, ahead of it, with an
upload left half done, behind it, holding other weights, holding weights that do not fit). Then the
loop's mesh client rides out a publish that fails (gateway unreachable) and a broker it cannot reach.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from pathlib import Path

import torch

from deltamesh.delta import encode_delta, encode_full
from deltamesh.delta.statement import load_statement
from deltamesh.gateway.config import GatewayConfig
from deltamesh.gateway.server.app import create_app
from deltamesh.gateway_client import statement_url
from deltamesh.http import client_session, request_bytes, request_json, serving
from deltamesh.trainer.mesh_client import MeshClient
from deltamesh.trainer.publish_settings import PublishSettings
from deltamesh.trainer.publisher import Publisher
from deltamesh.trainer.stream_start import gateway_weights, start_stream

MODEL = "policy"


def weights_at(step: int, *, seed: int = 0, names: tuple[str, ...] = ("embed.weight", "mlp.weight")) -> dict:
    """bf16 weights after `step` small updates: most words stay, some move by an ulp or so, like RL steps."""
    g = torch.Generator().manual_seed(seed)
    base = {n: torch.randn(64, 48, generator=g) for n in names}
    for _ in range(step):
        for t in base.values():
            t += torch.randn(t.shape, generator=g) * 1e-3
    return {n: t.to(torch.bfloat16) for n, t in base.items()}


def client_to(gateway: str, broker: str, key, *, full_every: int = 0, **kwargs) -> MeshClient:
    """The loop's mesh client publishing to `gateway` (1 MiB pieces, 2 connections), its broker `broker`."""
    publish = PublishSettings(gateway, MODEL, full_every=full_every, piece_bytes=1 << 20, connections=2)
    return MeshClient(broker=broker, key=key, publish=publish, broker_failover_s=0, **kwargs)


def running_gateway(store: Path, public_key: Path) -> contextlib.AbstractAsyncContextManager[str]:
    """A real gateway in this process on a loopback socket: `async with ... as url`."""
    config = GatewayConfig(store=str(store), trusted_keys=[str(public_key)], piece_wait_s=0.5, anonymous=True)
    return serving(create_app(config), "127.0.0.1:0")


async def listing(url: str) -> dict[int, dict[str, dict]]:
    async with client_session() as s:
        answer = await request_json(s, "GET", f"{url}/v1/models/{MODEL}/versions")
    out: dict[int, dict[str, dict]] = {}
    for e in answer["versions"]:
        out.setdefault(e["version"], {})[e["kind"]] = e
    return out


async def plan(url: str, frm: int | None, to: int) -> dict:
    async with client_session() as s:
        return await request_json(s, "GET", f"{url}/v1/models/{MODEL}/plan", params={"from": frm, "to": to})


async def publish_run(url: str, key, steps: range, *, seed: int = 0, full_every: int = 0) -> None:
    """A trainer that publishes weights_at(v) for v in `steps` and then crashes."""
    publisher = Publisher(url, key, MODEL, full_every=full_every)
    for v in steps:
        await publisher.publish(weights_at(v, seed=seed), v)


async def restarted(url: str, key, checkpoint: int):
    """A trainer started from its checkpoint, weights_at(checkpoint) at version `checkpoint`: (its
    publisher, what `start_stream` made of the gateway)."""
    publisher = Publisher(url, key, MODEL)
    return publisher, await start_stream(publisher, checkpoint, weights_at(checkpoint), [key.public_key()])


async def put_manifest_only(url: str, encoded) -> None:
    """An upload cut off after the manifest: announced at the gateway, no pieces."""
    m = encoded.manifest
    async with client_session() as s:
        await request_bytes(s, "PUT", f"{url}/v1/models/{MODEL}/versions/{m.version}/{m.kind}/manifest",
                            data=encoded.manifest_bytes, headers={"Content-Type": "application/json"})


def made(published) -> list[tuple[str, int | None]]:
    """(kind, base version) of each manifest a publish made."""
    return [(m.kind, m.base_version) for m in published.manifests]


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for n in a:
        assert torch.equal(a[n].view(torch.int16), b[n].view(torch.int16)), n


def run_with_gateway(tmp_path: Path, public: Path, scenario) -> None:
    async def main() -> None:
        async with running_gateway(tmp_path / "store", public) as url:
            await scenario(url)

    asyncio.run(main())


def test_first_start_publishes_a_full_snapshot_and_a_restart_at_the_head_sends_nothing(tmp_path, key_files):
    key, _, public = key_files

    async def scenario(url: str) -> None:
        first, start = await restarted(url, key, 0)
        assert (start.version, start.base_version) == (0, 0)
        assert [m.kind for m in start.published.manifests] == ["full"]
        await first.publish(weights_at(1), 1)
        # A restart whose checkpoint is the gateway's head: nothing to send, the next version is a delta on it.
        again, start = await restarted(url, key, 1)
        assert (start.version, start.base_version, start.published) == (1, 1, None)
        assert made(await again.publish(weights_at(2), 2)) == [("delta", 1)]
        assert sorted(await listing(url)) == [0, 1, 2]

    run_with_gateway(tmp_path, public, scenario)


def test_restart_behind_the_gateway_continues_after_its_head_with_a_delta(tmp_path, key_files):
    key, _, public = key_files

    async def scenario(url: str) -> None:
        await publish_run(url, key, range(0, 4))  # checkpointed at v1, published up to v3, crashed
        publisher, start = await restarted(url, key, 1)
        assert (start.version, start.base_version, start.published) == (3, 3, None)
        assert_same(dict(publisher.base[1]), weights_at(3))  # rebuilt from the chain 1 -> 3
        trained = weights_at(2, seed=7)  # what the restarted trainer makes of its checkpoint
        assert made(await publisher.publish(trained, 4)) == [("delta", 3)]
        route = await plan(url, 3, 4)
        assert [(s["version"], s["kind"]) for s in route["steps"]] == [(4, "delta")]

    run_with_gateway(tmp_path, public, scenario)


def test_an_upload_cut_off_by_the_crash_is_skipped_by_the_next_delta(tmp_path, key_files):
    key, _, public = key_files

    async def scenario(url: str) -> None:
        await publish_run(url, key, range(0, 3))
        lost = encode_delta(weights_at(2), weights_at(3), model_id=MODEL, version=3, base_version=2, key=key)
        await put_manifest_only(url, lost)
        assert not (await listing(url))[3]["delta"]["complete"]
        publisher, start = await restarted(url, key, 2)
        assert (start.version, start.base_version, start.published) == (3, 2, None)
        trained = weights_at(3, seed=5)
        assert made(await publisher.publish(trained, 4)) == [("delta", 2)]
        # A pool at v2 goes straight to v4; one at v1 follows 2 -> 4, never waiting on the broken v3.
        assert [s["version"] for s in (await plan(url, 2, 4))["steps"]] == [4]
        assert [s["version"] for s in (await plan(url, 1, 4))["steps"]] == [2, 4]

    run_with_gateway(tmp_path, public, scenario)


def test_a_lost_publish_is_republished_as_a_delta(tmp_path, key_files):
    key, _, public = key_files

    async def scenario(url: str) -> None:
        await publish_run(url, key, range(0, 3))  # checkpoint says v3, its publish never reached the gateway
        publisher, start = await restarted(url, key, 3)
        assert (start.version, start.base_version) == (3, 3)
        assert [(m.version, m.kind, m.base_version) for m in start.published.manifests] == [(3, "delta", 2)]
        versions = await listing(url)
        assert versions[3]["delta"]["complete"] and "full" not in versions[3]
        assert made(await publisher.publish(weights_at(4), 4)) == [("delta", 3)]

    run_with_gateway(tmp_path, public, scenario)


def test_gateway_holding_other_weights_becomes_the_base_of_the_next_delta(tmp_path, key_files):
    key, _, public = key_files

    async def scenario(url: str) -> None:
        await publish_run(url, key, range(0, 2), seed=9)  # another run under the same model_id
        publisher, start = await restarted(url, key, 1)
        assert (start.version, start.base_version, start.published) == (1, 1, None)
        assert_same(dict(publisher.base[1]), weights_at(1, seed=9))  # the gateway's v1, not ours
        assert made(await publisher.publish(weights_at(2), 2)) == [("delta", 1)]
        # Pools that hold the gateway's v1 reach exactly the trainer's weights.
        rebuilt = await gateway_weights(publisher, 2, [key.public_key()], have=(1, weights_at(1, seed=9)))
        assert_same(rebuilt, weights_at(2))

    run_with_gateway(tmp_path, public, scenario)


def test_gateway_weights_that_do_not_fit_fall_back_to_a_full_snapshot(tmp_path, key_files):
    key, _, public = key_files

    async def scenario(url: str) -> None:
        other = Publisher(url, key, MODEL)
        await other.publish(weights_at(0, names=("other.weight",)), 0)
        publisher, start = await restarted(url, key, 0)
        assert (start.version, start.base_version) == (1, 1)
        assert "do not fit" in start.reason or "differ" in start.reason
        assert [m.kind for m in start.published.manifests] == ["full"]
        assert made(await publisher.publish(weights_at(1), 2)) == [("delta", 1)]

    run_with_gateway(tmp_path, public, scenario)


def test_an_interrupted_first_full_snapshot_is_finished(tmp_path, key_files):
    key, _, public = key_files

    async def scenario(url: str) -> None:
        await put_manifest_only(url, encode_full(weights_at(0), model_id=MODEL, version=0, key=key))
        publisher, start = await restarted(url, key, 0)
        assert (start.version, start.base_version) == (0, 0)
        assert (await listing(url))[0]["full"]["complete"]

    run_with_gateway(tmp_path, public, scenario)


@contextlib.contextmanager
def gateway_in_thread(store: Path, public_key: Path):
    """A real gateway on a loopback socket, served from a thread of its own (for blocking callers)."""
    urls: list[str] = []
    started, stop = threading.Event(), None

    async def serve() -> None:
        nonlocal stop
        stop = asyncio.Event()
        async with running_gateway(store, public_key) as url:
            urls.append(url)
            started.set()
            await stop.wait()

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert started.wait(30)
    try:
        yield urls[0]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
        loop.close()


def test_a_failed_publish_does_not_stop_training_and_the_next_delta_skips_it(tmp_path, key_files, free_port):
    """An unreachable gateway for one publish and an unreachable broker throughout: the loop's client
    logs them, tells the step log, and the next version is a delta on the last one that got through."""
    key, _, public = key_files
    outcomes = []
    dead = f"http://127.0.0.1:{free_port}"
    with gateway_in_thread(tmp_path / "store", public) as url:
        client = client_to(url, dead, key, on_published=outcomes.append)
        try:
            assert client.start(0, weights_at(0), threading.Event()).published is not None
            client.publish(weights_at(1), 1)
            client.wait_published()
            client.publisher.gateway = dead  # the link to the gateway breaks for one publish
            client.publish(weights_at(2), 2)
            client.wait_published()
            client.publisher.gateway = url
            client.publish(weights_at(3), 3)
            client.wait_published()
        finally:
            client.close()
        assert [(o.version, o.ok) for o in outcomes] == [(1, True), (2, False), (3, True)]
        assert "unreachable" in outcomes[1].error
        versions = asyncio.run(listing(url))
        assert sorted(versions) == [0, 1, 3]
        assert versions[3]["delta"]["base_version"] == 1
        rebuilt = asyncio.run(gateway_weights(Publisher(url, key, MODEL), 3, [key.public_key()],
                                              have=(1, weights_at(1))))
        assert_same(rebuilt, weights_at(3))


def test_a_trainer_waiting_for_batches_publishes_a_failed_version_again(tmp_path, key_files, free_port):
    """The chaos soak's deadlock: the origin's disk was full for the trainer's last publishes, the broker
    then held the pools' leases back (they were more than the staleness bound behind the trainer) and
    the trainer waited for a batch that never came, its version never published. While it waits for
    batches, the version whose publish failed is published again until it gets through."""
    key, _, public = key_files
    outcomes = []
    dead = f"http://127.0.0.1:{free_port}"
    with gateway_in_thread(tmp_path / "store", public) as url:
        client = client_to(url, dead, key, on_published=outcomes.append)
        stop = threading.Event()
        try:
            client.start(0, weights_at(0), threading.Event())
            client.publisher.gateway = dead
            client.publish(weights_at(1), 1)
            client.wait_published()
            client.publisher.gateway = url  # the origin is back; no batch comes (the broker is unreachable)
            waiter = threading.Thread(target=client.next_batch, args=(4, 0.2, stop))
            waiter.start()
            deadline = time.monotonic() + 30
            while not any(o.ok for o in outcomes) and time.monotonic() < deadline:
                time.sleep(0.1)
            stop.set()
            waiter.join(30)
        finally:
            client.close()
        assert [(o.version, o.ok) for o in outcomes][:2] == [(1, False), (1, True)]
        assert len([o for o in outcomes if o.ok]) == 1  # once through, it is not published again
        versions = asyncio.run(listing(url))
        assert sorted(versions) == [0, 1]
        rebuilt = asyncio.run(gateway_weights(Publisher(url, key, MODEL), 1, [key.public_key()],
                                              have=(0, weights_at(0))))
        assert_same(rebuilt, weights_at(1))


def test_the_mesh_client_reports_when_each_stage_of_a_publish_ended(tmp_path, key_files, free_port):
    """The trainer's stage times ("step_end", "cast") and the publisher's reach the outcome, in order;
    with a periodic full, the delta is at the origin before the full is."""
    key, _, public = key_files
    outcomes = []
    dead = f"http://127.0.0.1:{free_port}"
    with gateway_in_thread(tmp_path / "store", public) as url:
        client = client_to(url, dead, key, on_published=outcomes.append, full_every=2)
        try:
            client.start(0, weights_at(0), threading.Event())
            for v in (1, 2):
                step_end = time.time()
                weights = weights_at(v)
                client.publish(weights, v, {"step_end": step_end, "cast": time.time()})
                client.wait_published()
        finally:
            client.close()
    order = ["step_end", "cast", "encoded", "signed", "upload_start", "uploaded"]
    assert [(o.version, o.ok, o.kinds) for o in outcomes] == [(1, True, ["delta"]), (2, True, ["delta", "full"])]
    for o in outcomes:
        stamps = [o.stages[k] for k in order]
        assert stamps == sorted(stamps), o.stages
    assert outcomes[1].stages["uploaded"] <= outcomes[1].stages["full_encoded"] <= outcomes[1].stages["full_uploaded"]


def test_the_trainer_re_signs_its_head_statement_between_versions(tmp_path, key_files, free_port):
    """With `statement_every_s`, the origin's head statement keeps getting fresher while no version
    comes, so pools that require fresh statements can tell a frozen gateway from a trainer between steps."""
    key, _, public = key_files
    dead = f"http://127.0.0.1:{free_port}"

    async def issued(url: str) -> int:
        async with client_session(timeout_s=10) as s:
            raw = await request_bytes(s, "GET", statement_url(url, MODEL))
        return load_statement(raw, [key.public_key()], model=MODEL).issued_ms

    with gateway_in_thread(tmp_path / "store", public) as url:
        client = client_to(url, dead, key, statement_every_s=0.2)
        try:
            client.start(0, weights_at(0), threading.Event())
            first = asyncio.run(issued(url))
            deadline = time.monotonic() + 10
            while asyncio.run(issued(url)) == first:
                assert time.monotonic() < deadline, "no fresher statement within 10 s"
                time.sleep(0.1)
        finally:
            client.close()


def test_wait_encoded_returns_once_the_version_is_encoded_while_its_upload_goes_on(tmp_path, key_files, free_port):
    """`encode_first`'s wait: it ends when the version is encoded, not when the upload does (here an
    origin that accepts connections and never answers), and at once when a publish fails before it
    encoded anything."""
    key, _, public = key_files
    outcomes = []
    dead = f"http://127.0.0.1:{free_port}"
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)  # the kernel completes the handshakes; nothing ever reads or answers
    with gateway_in_thread(tmp_path / "store", public) as url:
        client = client_to(url, dead, key, on_published=outcomes.append)
        try:
            client.start(0, weights_at(0), threading.Event())
            assert client.wait_encoded() < 0.1  # nothing in flight
            client.publisher.gateway = f"http://127.0.0.1:{silent.getsockname()[1]}"
            client.publish(weights_at(1), 1)
            client.wait_encoded()
            time.sleep(0.3)
            assert client._publishing.in_flight, "the upload is still under way"
            silent.close()  # the connections are reset: the publish fails
            client.wait_published()
            client.publisher.gateway = url
            client.publish(weights_at(1), 0)  # refused before encoding: not after the base, v0
            client.wait_encoded()
            client.wait_published()
        finally:
            silent.close()
            client.close()
    assert [(o.version, o.ok) for o in outcomes] == [(1, False), (0, False)]
    assert "not after the last published" in outcomes[1].error
