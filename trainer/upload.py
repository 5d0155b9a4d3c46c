"""The publish protocol, client side: put a signed manifest and its pieces onto an origin gateway.

`upload_version` sends the signed envelope (`PUT .../manifest`), then the pieces the gateway does not
hold yet (`PUT .../pieces/{i}`), several at a time. A version built in parts goes the other way round:
each trainer rank stages its own pieces (`stage_pieces`), then rank 0 sends the manifest
(`put_staged_manifest`), which the origin takes only when every piece is staged. Uploading the same version again only sends what
is missing, so a publish interrupted half-way is finished by running it again. A gateway whose disk
is full answers 507 and keeps nothing of the version: that is raised at once (HttpError, status 507),
not retried, so the publisher can report it and publish again once there is room.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence

import aiohttp

from deltamesh.delta.manifest import Manifest
from deltamesh.gateway.fetch.lanes import run_lanes_of
from deltamesh.gateway_client import staged_url, version_url
from deltamesh.http import HttpError, request_bytes
from deltamesh.peer_json import parse_json


async def upload_version(
    session: aiohttp.ClientSession,
    gateway: str,
    manifest: Manifest,
    manifest_bytes: bytes,
    pieces: Sequence[bytes],
    *,
    connections: int = 4,
    on_progress: Callable[[int], None] | None = None,
    retries: int = 3,
) -> int:
    """Publish one (model, version, kind); returns the number of piece bytes sent."""
    base = version_url(gateway.rstrip("/"), manifest.model_id, manifest.version, manifest.kind)
    # The envelope goes as the exact bytes that were signed; re-serializing could change them.
    raw = await request_bytes(session, "PUT", f"{base}/manifest", data=manifest_bytes,
                              headers={"Content-Type": "application/json"})
    try:
        answer = parse_json(raw)
        missing = [int(i) for i in answer["missing"]]
    except (ValueError, KeyError, TypeError) as e:
        raise HttpError(200, f"answer to the manifest is not what a gateway sends: {e}", f"{base}/manifest") from e
    if any(not 0 <= i < len(pieces) for i in missing):
        raise HttpError(200, f"the gateway asks for pieces outside 0..{len(pieces) - 1}", f"{base}/manifest")
    return await _put_all(session, [(f"{base}/pieces/{i}", pieces[i]) for i in missing], connections=connections,
                          on_progress=on_progress, retries=retries)


async def stage_pieces(
    session: aiohttp.ClientSession, gateway: str, model: str, pieces: Sequence[bytes], digests: Sequence[str], *,
    connections: int = 4, on_progress: Callable[[int], None] | None = None, retries: int = 3,
) -> int:
    """Stage pieces of a version built in parts on the origin, each under its content digest, before the
    manifest that names them exists (`deltamesh.gateway.server.staging`); returns the bytes sent."""
    return await _put_all(session, [(staged_url(gateway, model, h), data) for h, data in zip(digests, pieces)],
                          connections=connections, on_progress=on_progress, retries=retries)


async def put_staged_manifest(session: aiohttp.ClientSession, gateway: str, manifest: Manifest,
                              manifest_bytes: bytes) -> None:
    """Send the signed manifest of a version whose pieces its ranks have staged: the origin accepts it
    only with all of them staged, and announces the version whole (an HttpError 409 names what is not)."""
    base = version_url(gateway.rstrip("/"), manifest.model_id, manifest.version, manifest.kind)
    await request_bytes(session, "PUT", f"{base}/manifest?staged=1", data=manifest_bytes,
                        headers={"Content-Type": "application/json"})


async def _put_all(session: aiohttp.ClientSession, puts: Sequence[tuple[str, bytes]], *, connections: int,
                   on_progress: Callable[[int], None] | None, retries: int) -> int:
    """PUT each (url, body) on up to `connections` at once, retrying failures that waiting may cure."""
    queue: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
    for put in puts:
        queue.put_nowait(put)
    sent = 0

    async def worker() -> None:
        nonlocal sent
        while True:
            try:
                url, data = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            for attempt in range(retries + 1):
                try:
                    await request_bytes(session, "PUT", url, data=data,
                                        headers={"Content-Type": "application/octet-stream"})
                    break
                except HttpError as e:
                    if e.status != 0 and e.status < 500 or e.status == 507 or attempt == retries:
                        raise  # a refusal, or a full disk (waiting a moment would not help)
                    await asyncio.sleep(0.2 * 2 ** attempt)
            sent += len(data)
            if on_progress is not None:
                on_progress(len(data))

    await run_lanes_of(worker, max(1, min(connections, len(puts))))
    return sent
