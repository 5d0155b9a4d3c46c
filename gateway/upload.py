"""The publish protocol, client side: put a signed manifest and its pieces onto an origin gateway.

`upload_version` sends the signed envelope (`PUT .../manifest`), then the pieces the gateway does not
hold yet (`PUT .../pieces/{i}`), several at a time. Uploading the same version again only sends what
is missing, so a publish interrupted half-way is finished by running it again. A gateway whose disk
is full answers 507 and keeps nothing of the version: that is raised at once (HttpError, status 507),
not retried, so the publisher can report it and publish again once there is room.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Sequence

import aiohttp

from deltamesh.delta.manifest import Manifest
from deltamesh.http import HttpError, request_bytes
from deltamesh.peer_json import parse_json
from deltamesh.gateway.fetch_lanes import run_lanes_of
from deltamesh.gateway_client import version_url


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
    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in missing:
        queue.put_nowait(i)
    sent = 0

    async def worker() -> None:
        nonlocal sent
        while True:
            try:
                i = queue.get_nowait()
            except asyncio.QueueEmpty:
                return
            for attempt in range(retries + 1):
                try:
                    await request_bytes(session, "PUT", f"{base}/pieces/{i}", data=pieces[i],
                                        headers={"Content-Type": "application/octet-stream"})
                    break
                except HttpError as e:
                    if e.status != 0 and e.status < 500 or e.status == 507 or attempt == retries:
                        raise  # a refusal, or a full disk (waiting a moment would not help)
                    await asyncio.sleep(0.2 * 2 ** attempt)
            sent += len(pieces[i])
            if on_progress is not None:
                on_progress(len(pieces[i]))

    await run_lanes_of(worker, max(1, min(connections, len(missing))))
    return sent
