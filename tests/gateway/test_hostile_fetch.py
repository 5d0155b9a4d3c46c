"""Fetching from slow and hostile sources: a trickle, a stall mid-piece, a short body, flipped bytes.

Against the hostile proxy of hostile.py (in front of a real in-process gateway), with and without an
honest alternate: a fetch either finishes within two stall timeouts plus its transfer time, keeping
what the bad source delivered, or fails with one FetchError that names the piece and the source;
a source that serves bad bytes is asked a bounded number of times. Then a pool's whole sync round
(in process, and `deltamesh pool sync --once` as a process) against a trickling gateway.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

import deltamesh_test_hostile as hostile  # a helper module of this folder, loaded by its conftest.py
import pytest

from deltamesh.delta.manifest import load_manifest
from deltamesh.gateway.fetch.fetcher import Fetcher, FetchError
from deltamesh.gateway.fetch.sources import Source
from deltamesh.http import client_session
from deltamesh.mesh.pool.sync_config import PoolSyncConfig
from deltamesh.trainer.publisher import Publisher
from deltamesh.trainer.upload import upload_version

MODEL = "m"
STALL = 1.0
PIECE = 64 * 1024


async def _fetch(kit, url: str, bad, *, alternate: bool) -> tuple[float, dict[int, bytes] | FetchError, list]:
    """Publish a version of 4 pieces at the gateway at `url`, then fetch it with the hostile proxy
    first and (with `alternate`) an honest proxy second; (seconds, pieces or the error, the honest
    proxy's requests)."""
    m, raw, pieces = kit.version(MODEL, 1, "full", pieces=4, piece_size=PIECE)
    async with client_session() as s:
        await upload_version(s, url, m, raw, pieces)
    honest = hostile.Hostile(url)
    async with bad.serving(), honest.serving(), client_session(connections=32, timeout_s=None) as s:
        sources = [Source(bad.url)] + ([Source(honest.url)] if alternate else [])
        fetcher = Fetcher(s, sources, "test", stall_timeout_s=STALL, give_up_s=30, penalty_s=1.0)
        got: dict[int, bytes] = {}

        async def accept(raw: bytes):
            return load_manifest(raw, [kit.key.key.public_key()])

        async def keep(i: int, data: bytearray) -> None:
            got[i] = bytes(data)

        t0 = time.monotonic()
        try:
            manifest = await fetcher.manifest_bytes(MODEL, 1, "full", accept, prefetch=4)
            await fetcher.pieces(manifest, range(4), 4, keep)
        except FetchError as e:
            return time.monotonic() - t0, e, honest.ranges
        assert got == dict(enumerate(pieces))
        return time.monotonic() - t0, got, honest.ranges


def _run(kit, tmp_path, mode, *, alternate: bool):
    bad = None

    async def main():
        nonlocal bad
        async with kit.running_gateway(kit.config(tmp_path)) as url:
            bad = hostile.Hostile(url, mode)
            return await _fetch(kit, url, bad, alternate=alternate)

    took, result, honest_ranges = asyncio.run(main())
    return took, result, honest_ranges, bad


def _continued(ranges) -> list[int]:
    """Where the honest source was asked to start each piece (0 for a whole piece)."""
    return [int(r.split("=")[1].split("-")[0]) if r else 0 for _, _, _, r in ranges]


@pytest.mark.parametrize("mode", [hostile.Mode(trickle_bps=2000), hostile.Mode(stall_after=5000),
                                  hostile.Mode(short_after=5000)], ids=["trickle", "stall", "short"])
def test_a_slow_or_broken_source_is_left_and_the_piece_continues_from_the_alternate(kit, tmp_path, mode):
    took, got, ranges, bad = _run(kit, tmp_path, mode, alternate=True)
    assert isinstance(got, dict)
    assert took < 2 * STALL + 1.0, f"took {took:.1f}s"
    starts = _continued(ranges)
    assert len(starts) == 4 and all(s > 0 for s in starts), f"what arrived was fetched again: {ranges}"


@pytest.mark.slow
@pytest.mark.parametrize("mode", [hostile.Mode(trickle_bps=2000), hostile.Mode(stall_after=5000),
                                  hostile.Mode(short_after=5000)], ids=["trickle", "stall", "short"])
def test_a_slow_or_broken_only_source_fails_the_version_with_one_clear_error(kit, tmp_path, mode):
    took, error, _, bad = _run(kit, tmp_path, mode, alternate=False)
    assert isinstance(error, FetchError), error
    message = str(error)
    assert "piece" in message and bad.url in message and "3 failed requests" in message, message
    assert took < 3 * (STALL + 1.0), f"took {took:.1f}s to give up"
    assert max(bad.piece_requests.values()) <= 3


def test_a_tampering_source_is_asked_a_bounded_number_of_times(kit, tmp_path):
    took, got, _, bad = _run(kit, tmp_path, hostile.Mode(flip=True), alternate=True)
    assert isinstance(got, dict) and took < 2 * STALL
    assert max(bad.piece_requests.values()) <= 2  # its prefetch, and at most one more before it is avoided
    took, error, _, bad = _run(kit, tmp_path / "alone", hostile.Mode(flip=True), alternate=False)
    assert isinstance(error, FetchError) and "no source served it intact" in str(error) and "bad bytes" in str(error)
    assert max(bad.piece_requests.values()) <= 10 and took < 5.0


def _pool(kit, tmp_path: Path, gateways: list[str]) -> PoolSyncConfig:
    return PoolSyncConfig(gateways=gateways, token="region-token-1", name="p", dir=str(tmp_path / "pool"),
                          trusted_keys=[str(kit.key.public)], model=MODEL, stall_timeout_s=STALL, give_up_s=60.0)


@pytest.mark.slow
def test_a_pool_sync_leaves_a_trickling_gateway_for_its_alternate_in_time(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url:
            w = kit.tiny_weights()
            await Publisher(url, kit.key.key, MODEL, piece_bytes=4096).publish(w)
            async with hostile.Hostile(url, hostile.Mode(trickle_bps=2000)).serving() as bad:
                took = await kit.timed_sync(_pool(kit, tmp_path, [bad.url, url]), w)
            assert took < 2 * STALL + 1.5, f"sync took {took:.1f}s"

    asyncio.run(main())


@pytest.mark.slow
def test_pool_sync_once_against_only_a_trickling_gateway_fails_with_one_clear_error(kit, tmp_path):
    async def main():
        async with kit.running_gateway(kit.config(tmp_path)) as url:
            await Publisher(url, kit.key.key, MODEL, piece_bytes=4096).publish(kit.tiny_weights())
            async with hostile.Hostile(url, hostile.Mode(trickle_bps=2000)).serving() as bad:
                deltamesh = str(Path(sys.executable).with_name("deltamesh"))
                t0 = time.monotonic()
                proc = await asyncio.create_subprocess_exec(
                    deltamesh, "pool", "sync", "--once", "--gateway", bad.url,
                    "--name", "p", "--dir", str(tmp_path / "pool"), "--trusted-key", str(kit.key.public),
                    "--model", MODEL, "--stall-timeout-s", str(STALL),
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
                    env={**os.environ, "DELTAMESH_LOG": "INFO", "DELTAMESH_TOKEN": "region-token-1"})
                out, _ = await asyncio.wait_for(proc.communicate(), 60)
                return proc.returncode, out.decode(errors="replace"), time.monotonic() - t0, bad

    code, out, took, bad = asyncio.run(main())
    errors = [line for line in out.splitlines() if " E " in line]
    assert code == 1, out
    assert len(errors) == 1 and "no source served it intact" in errors[0] and "too slow" in errors[0], out
    assert max(bad.piece_requests.values()) <= 3
    assert took < 30, f"gave up after {took:.0f}s"
