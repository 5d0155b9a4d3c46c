"""Parts of the newest whole version, asked for before the version is known: the gateway's route (what
it serves, what it refuses), a fetcher that takes a version from its parts, parts that come bad,
short or of another version (their pieces are fetched the usual way, and checked), parts read no
further than their early limit before the manifest is known, and a cold pool
that starts on parts while a warm one does not. Real gateways on loopback; the misbehaving source is
`hostile.py`'s proxy in front of a real gateway."""

from __future__ import annotations

import asyncio

import aiohttp
import deltamesh_test_hostile as hostile  # a helper module of this folder, loaded by its conftest.py
import pytest

from deltamesh.delta.manifest import load_manifest
from deltamesh.gateway.fetch.fetcher import Fetcher
from deltamesh.gateway.fetch.http_reads import Progress
from deltamesh.gateway.fetch.parts import EarlyParts
from deltamesh.gateway.fetch.sources import Source
from deltamesh.gateway.version_parts import MAX_PARTS, SPAN_HEADER, VERSION_HEADER
from deltamesh.http import client_session
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.mesh.pool.weight_sync import WeightSync
from deltamesh.trainer.publisher import Publisher
from deltamesh.trainer.upload import upload_version

MODEL = "m"
STALL = 1.5


async def _part(s: aiohttp.ClientSession, url: str, k: int | str, of: int | str, kind: str = "full"):
    async with s.get(f"{url}/v1/models/{MODEL}/newest/{kind}/parts/{k}", params={"of": str(of)}) as r:
        return r.status, r.headers.get(VERSION_HEADER), r.headers.get(SPAN_HEADER), await r.read()


def test_parts_tile_the_newest_whole_version_byte_for_byte(kit, tmp_path):
    m1, raw1, p1 = kit.version(MODEL, 1, "full", pieces=5, piece_size=1003)
    m2, raw2, p2 = kit.version(MODEL, 2, "full", pieces=2, piece_size=700)

    async def main() -> None:
        async with kit.running_gateway(kit.config(tmp_path)) as url, client_session(connections=8) as s:
            assert (await _part(s, url, 0, 1))[0] == 404  # nothing whole here yet
            await upload_version(s, url, m1, raw1, p1)
            answers = [await _part(s, url, k, 3) for k in range(3)]
            assert [a[:2] for a in answers] == [(200, "1")] * 3
            assert [a[2] for a in answers] == ["0-1671/5015", "1671-3343/5015", "3343-5015/5015"]
            assert b"".join(a[3] for a in answers) == b"".join(p1)
            # v2 announced, one piece of two in: the newest full is not whole, and v1's parts would be
            # of no use to a first pull (it starts from v2): none are served until v2 is whole.
            v2 = f"{url}/v1/models/{MODEL}/versions/2/full"
            for path, body in [("manifest", raw2), ("pieces/0", p2[0])]:
                async with s.put(f"{v2}/{path}", data=body) as r:
                    assert r.status == 201, await r.text()
            assert (await _part(s, url, 0, 3))[0] == 404
            await upload_version(s, url, m2, raw2, p2)
            status, version, span, body = await _part(s, url, 0, 1)
            assert (status, version, span, body) == (200, "2", "0-1400/1400", b"".join(p2))
            assert (await _part(s, url, 0, 1, kind="delta"))[0] == 404  # no delta is whole here
            for k, of in [(3, 3), (0, 0), (0, MAX_PARTS + 1), ("x", 2), (-1, 2), (0, "two")]:
                status, version, _, body = await _part(s, url, k, of)
                assert status == 400 and version is None, (k, of, status)
            assert (await _part(s, url, 0, 2, kind="weights"))[0] == 400

    asyncio.run(main())


def _accept_with(kit):
    async def accept(raw: bytes):
        return load_manifest(raw, [kit.key.key.public_key()])
    return accept


async def _fetch_with_parts(kit, s, url: str, fetch_from: str, version: int, of: int) -> dict[int, bytes]:
    """Ask `fetch_from` for `of` parts of the newest full, then fetch `version` with them; the pieces got."""
    fetcher = Fetcher(s, [Source(fetch_from), Source(url)], "pool/p", stall_timeout_s=STALL, give_up_s=30)
    parts = fetcher.ask_parts(MODEL, "full", of)
    manifest = await fetcher.manifest_bytes(MODEL, version, "full", _accept_with(kit))
    got: dict[int, bytes] = {}

    async def keep(i: int, data: bytearray) -> None:
        assert i not in got, f"piece {i} handed over twice"
        got[i] = bytes(data)

    await fetcher.pieces(manifest, range(len(manifest.pieces)), of, keep, parts)
    return got


def _run(kit, tmp_path, mode: hostile.Mode, *, held: int = 1, of: int = 4):
    """Fetch v1 with `of` parts through `mode`'s proxy, the gateway holding v1 .. v`held` whole."""
    versions = [kit.version(MODEL, v, "full", pieces=3, piece_size=5000) for v in range(1, held + 1)]

    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url, client_session(connections=16) as s:
            for m, raw, pieces in versions:
                await upload_version(s, url, m, raw, pieces)
            async with hostile.Hostile(url, mode).serving() as proxy:
                got = await _fetch_with_parts(kit, s, url, proxy.url, 1, of)
                return got, proxy

    got, proxy = asyncio.run(main())
    assert got == dict(enumerate(versions[0][2])), "every piece, byte for byte"
    return proxy


def test_a_fetcher_takes_a_version_from_its_parts_without_asking_for_a_piece(kit, tmp_path):
    proxy = _run(kit, tmp_path, hostile.Mode())
    assert dict(proxy.part_requests) == {k: 1 for k in range(4)}
    assert not proxy.piece_requests, proxy.piece_requests


@pytest.mark.parametrize("mode", [hostile.Mode(flip=True), hostile.Mode(short_after=1000)], ids=["flipped", "short"])
def test_bad_or_short_parts_leave_their_pieces_to_be_fetched_and_checked(kit, tmp_path, mode):
    proxy = _run(kit, tmp_path, mode)
    assert sum(proxy.part_requests.values()) == 4
    # Every part was spoilt, so no piece came whole from them: the source that spoilt them is asked last.
    assert not proxy.piece_requests, proxy.piece_requests


def test_parts_of_another_version_are_dropped(kit, tmp_path):
    """The gateway holds v1 and v2 whole; a fetch of v1 gets parts that say v2 (the newest) and drops
    them; and parts that claim v1 but carry v2's bytes fail their pieces' checks."""
    proxy = _run(kit, tmp_path / "newer", hostile.Mode(), held=2, of=3)
    assert sum(proxy.part_requests.values()) == 3
    assert {index for _, _, index in proxy.piece_requests} == {0, 1, 2}  # from the source it has been best
    proxy = _run(kit, tmp_path / "lying", hostile.Mode(part_version=1), held=2, of=3)
    assert sum(proxy.part_requests.values()) == 3 and not proxy.piece_requests  # all failed: asked elsewhere


def test_a_cold_pool_starts_on_parts_and_a_warm_one_does_not(kit, tmp_path):
    """A cold pool asks for parts with its first head poll, never while it only registers."""
    w1 = kit.tiny_weights()
    w2 = kit.next_step(w1, 1)

    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url:
            publisher = Publisher(url, kit.key.key, MODEL, piece_bytes=4096)
            await publisher.publish(w1)
            async with hostile.Hostile(url, hostile.Mode()).serving() as proxy:
                config = PoolSyncConfig(gateways=[proxy.url], token="region-token-1", name="p",
                                        dir=str(tmp_path / "pool"), trusted_keys=[str(kit.key.public)], model=MODEL,
                                        connections=3, stall_timeout_s=STALL)
                # Showing its credentials (as `pool run` does before it starts anything) asks for no parts.
                async with WeightSync(config) as sync:
                    await sync.register_once()
                assert not proxy.part_requests and not proxy.piece_requests
                await kit.timed_sync(config, w1)
                assert dict(proxy.part_requests) == {0: 1, 1: 1, 2: 1}
                assert not proxy.piece_requests, "the first version came in parts alone"
                await publisher.publish(w2)
                await kit.timed_sync(config, w2)  # the pool holds v1: no parts, pieces of the delta
                assert sum(proxy.part_requests.values()) == 3 and proxy.piece_requests

    asyncio.run(main())


def test_a_part_is_read_no_further_than_its_early_limit_until_the_manifest_is_known(kit, tmp_path):
    """Before the manifest says what a part is, a part is read only up to its early limit and then left
    unread (the sender waits); once the manifest is verified the rest streams into the pieces, and
    the version comes whole from the parts."""
    m, raw, pieces = kit.version(MODEL, 1, "full", pieces=3, piece_size=300_000)  # parts of 450,000 bytes

    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url, client_session(connections=8) as s:
            await upload_version(s, url, m, raw, pieces)
            async with hostile.Hostile(url, hostile.Mode()).serving() as proxy:
                fetcher = Fetcher(s, [Source(proxy.url)], "pool/p", stall_timeout_s=STALL, give_up_s=30)
                taken = []

                async def counted(n: int) -> None:
                    taken.append(n)

                parts = EarlyParts.ask(s, Source(proxy.url), "pool/p", MODEL, "full", 2,
                                       Progress(STALL, STALL, 1024.0), 100_000, counted)
                await asyncio.sleep(STALL * 1.5)  # longer than the parts' progress deadline: held, not dropped
                early = sum(taken)
                manifest = await fetcher.manifest_bytes(MODEL, 1, "full", _accept_with(kit))
                got: dict[int, bytes] = {}

                async def keep(i: int, data: bytearray) -> None:
                    got[i] = bytes(data)

                await fetcher.pieces(manifest, range(3), 2, keep, parts)
                return got, early, sum(taken), proxy

    got, early, total, proxy = asyncio.run(main())
    assert early == 2 * 100_000, early
    assert got == dict(enumerate(pieces)) and total == 900_000
    assert sum(proxy.part_requests.values()) == 2 and not proxy.piece_requests, proxy.piece_requests
