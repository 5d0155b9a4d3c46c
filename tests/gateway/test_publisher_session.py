"""The publisher's connections and stages, against real `deltamesh gateway` processes.

One client session is kept open across versions: a TCP forwarder in front of the gateway counts the
connections the publisher opens through it (none after the first version; all closed on `aclose`).
A gateway that restarts (its connections gone) or is down for one publish is reconnected to. Each
version's stages are present and in order, and the periodic full reaches the gateway's store only
after the delta of the same version is whole there.
"""

from __future__ import annotations

import asyncio
import time
from urllib.parse import urlsplit

import pytest

from deltamesh.http import HttpError
from deltamesh.trainer.publisher import Publisher

MODEL = "tiny"
PIECE = 4096
STAGES = ["encoded", "signed", "upload_start", "uploaded"]


class CountingForwarder:
    """Forwards TCP connections to `port`, counting those accepted and those still open."""

    def __init__(self, port: int):
        self.port = port
        self.accepted = 0
        self.open = 0
        self.server: asyncio.Server | None = None

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self.open += 1
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            self.open -= 1
            writer.close()

    async def close(self) -> None:
        if self.server is not None:
            self.server.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


async def _until(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.05)


def test_the_publisher_keeps_its_connections_across_versions(spawn_gateway, kit):
    gw = spawn_gateway("origin")

    async def run() -> tuple[int, int]:
        forwarder = CountingForwarder(urlsplit(gw.url).port)
        url = await forwarder.start()
        pub = Publisher(url, kit.key.key, MODEL, full_every=3, piece_bytes=PIECE, connections=2)
        try:
            w = kit.tiny_weights()
            await pub.publish(w, 0)  # a full of several pieces: as many lanes as any later version needs
            first = forwarder.accepted
            for v in range(1, 5):  # deltas, and at v3 a delta and a full
                w = kit.next_step(w, v)
                await pub.publish(w, v)
            after = forwarder.accepted
            await pub.aclose()
            await _until(lambda: forwarder.open == 0, 10, "connections still open after aclose")
            return first, after
        finally:
            await forwarder.close()

    first, after = asyncio.run(run())
    assert 1 <= first <= 4
    assert after == first, f"{after - first} new connections after the first version"


def test_the_publisher_reconnects_after_the_gateway_restarts(spawn_gateway, kit):
    gw = spawn_gateway("origin")

    async def run() -> None:
        async with Publisher(gw.url, kit.key.key, MODEL, full_every=0, piece_bytes=PIECE) as pub:
            w = kit.tiny_weights()
            await pub.publish(w, 0)
            w = kit.next_step(w, 1)
            await pub.publish(w, 1)
            gw.kill()  # its connections die with it
            await asyncio.to_thread(gw.proc.wait, 10)
            await asyncio.to_thread(gw.start)
            w = kit.next_step(w, 2)
            assert (await pub.publish(w, 2)).version == 2
            gw.kill()
            await asyncio.to_thread(gw.proc.wait, 10)
            w3 = kit.next_step(w, 3)
            with pytest.raises(HttpError) as down:
                await pub.publish(w3, 3)
            assert down.value.status == 0
            await asyncio.to_thread(gw.start)
            assert (await pub.publish(w3, 3)).version == 3

    asyncio.run(run())
    listed = gw.store / "models" / MODEL
    assert sorted(int(p.name) for p in listed.iterdir() if p.name.isdigit()) == [0, 1, 2, 3]


def test_stages_are_ordered_and_the_delta_is_stored_before_the_full(spawn_gateway, kit):
    gw = spawn_gateway("origin")

    async def run() -> list:
        async with Publisher(gw.url, kit.key.key, MODEL, full_every=2, piece_bytes=PIECE) as pub:
            w = kit.tiny_weights()
            out = []
            for v in range(3):
                w = kit.next_step(w, v) if v else w
                before = time.time()
                published = await pub.publish(w, v)
                out.append((before, time.time(), published))
            return out

    runs = asyncio.run(run())
    for before, after, published in runs:
        stamps = [published.stages[k] for k in STAGES]
        assert stamps == sorted(stamps) and before <= stamps[0] and stamps[-1] <= after, published.stages
    kinds = [[m.kind for m in p.manifests] for _, _, p in runs]
    assert kinds == [["full"], ["delta"], ["delta", "full"]]
    last = runs[2][2].stages
    assert last["uploaded"] <= last["full_encoded"] <= last["full_uploaded"]
    assert "full_encoded" not in runs[1][2].stages
    # The store writes each file once, whole (temporary name, then rename): its mtime is its arrival.
    version = gw.store / "models" / MODEL / "2"
    delta_files = [version / "delta" / "manifest.json", *(version / "delta" / "pieces").iterdir()]
    assert max(f.stat().st_mtime_ns for f in delta_files) < (version / "full" / "manifest.json").stat().st_mtime_ns


def test_no_tensor_is_hashed_twice(spawn_gateway, kit, monkeypatch):
    """After the first version, a delta hashes only the new weights (in its scan: the base's hash is
    remembered) and a periodic full takes its tensor hashes from the delta's table."""
    from deltamesh.delta import parts, tensors

    gw = spawn_gateway("origin")
    hashed, base_hashed = [], []
    digest, tiles, scan = tensors.tensor_digest, parts._tiles, parts.scan_changes

    def counting_digest(t, grid=None):
        hashed.append(t.numel())
        return digest(t, grid)

    def counting_tiles(words, shape, h, one_tile):
        hashed.append(words.size)
        return tiles(words, shape, h, one_tile)

    def watching_scan(base, new, hash_base, hash_new, sample=None):
        base_hashed.append(hash_base is not None)
        return scan(base, new, hash_base, hash_new, sample)

    monkeypatch.setattr(tensors, "tensor_digest", counting_digest)
    monkeypatch.setattr(parts, "_tiles", counting_tiles)
    monkeypatch.setattr(parts, "scan_changes", watching_scan)

    async def run() -> list[list[str]]:
        async with Publisher(gw.url, kit.key.key, MODEL, full_every=2, piece_bytes=PIECE) as pub:
            w = kit.tiny_weights()
            await pub.publish(w, 0)
            assert hashed, "the first full hashes its tensors"
            hashed.clear()
            kinds = []
            for v in (1, 2):
                w = kit.next_step(w, v)
                kinds.append([m.kind for m in (await pub.publish(w, v)).manifests])
            return kinds

    assert asyncio.run(run()) == [["delta"], ["delta", "full"]]
    assert hashed == [] and base_hashed and not any(base_hashed)
