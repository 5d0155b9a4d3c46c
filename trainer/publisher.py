"""The trainer's publisher: encode each new version against the previous one, sign it, upload it.

`Publisher.publish(weights)` makes version v a delta against the last version it published (and
also a full snapshot every `full_every` versions; the first version it publishes is a full
snapshot), signs the manifests with the trainer key and streams them to the origin gateway with
`deltamesh.trainer.upload`. The delta is encoded, signed and uploaded before the periodic full is
even encoded, so pools that follow the chain can start at once; the full follows, its tensor hashes
taken from the delta's table rather than computed again. Uploads ride one client session kept open
across versions (warm connections, no new TLS handshakes), opened on first use, dropped after a
connection failure (the next publish opens a fresh one), closed by `aclose` or when the event loop
that opened it ends. `Published.stages` holds the wall-clock time (time.time()) each stage ended:
"encoded", "signed", "upload_start", "uploaded" (the origin holds the version), and for a periodic
full also "full_encoded" and "full_uploaded". Once a version is up, a signed head statement naming
it (`deltamesh.delta.statement`) follows, and `publish_statement` signs a fresh one for the same
version between versions, so pools that require fresh statements see the trainer is alive (its
failure is logged, never fatal: the version is published). A publisher that starts without a base
(a new process) asks the gateway for its head and continues the numbering with a full snapshot,
which is always a valid plan for every pool. It speaks to the gateway as the trainer, through its
`link` (origin_link.py: the kept session, the `token` and `tls`). The origin refuses a version below
its head or one it accepted before (409).

Each version carries the model directory's side files (`side_files`: config, tokenizer, generation
settings; `deltamesh.delta.side_files`), hashed and signed in its manifest, so a fresh pool's directory
loads with `from_pretrained`. A delta re-ships only those that changed since the version it is
encoded against.

`PublishState` keeps the last published weights on disk, so the one-shot `deltamesh publish` command
can encode a delta against them next time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from dataclasses import KW_ONLY, dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import aiohttp
import torch

from deltamesh.delta import Encoded, encode_delta, encode_full, read_weights, weights_hash, write_weights
from deltamesh.delta.encode import table_of
from deltamesh.delta.keys import Ed25519PrivateKey
from deltamesh.delta.layouts import PoolLayout, cuts_for
from deltamesh.delta.manifest import Manifest
from deltamesh.delta.side_files import read_side_files
from deltamesh.gateway.config import DEFAULT_PIECE_BYTES
from deltamesh.http import HttpError
from deltamesh.tls import TlsSettings
from deltamesh.trainer.origin_link import OriginLink
from deltamesh.trainer.publish_settings import PublishSettings, check_publish_numbers
from deltamesh.trainer.upload import upload_version

log = logging.getLogger(__name__)


@dataclass
class Published:
    version: int
    manifests: list[Manifest]
    bytes_sent: int
    stages: dict[str, float] = field(default_factory=dict)
    """Wall-clock time (time.time()) each stage ended: see the module's docstring."""


@dataclass(eq=False, repr=False)  # one publisher is one stream of versions; a repr would print the base weights
class Publisher:
    gateway: str
    key: Ed25519PrivateKey
    model_id: str
    _: KW_ONLY
    full_every: int = 10
    piece_bytes: int = DEFAULT_PIECE_BYTES
    connections: int = 4
    on_progress: Callable[[int], None] | None = None
    on_encoded: Callable[[Encoded], None] | None = None
    token: str | None = None
    tls: TlsSettings | None = None
    side_files: Mapping[str, bytes] | None = None
    """The model directory's side files (name -> bytes), shipped with every version; None: none."""
    layouts: Sequence[PoolLayout] = ()
    """Layouts of the tensor- or expert-parallel pools that follow the model: each version is cut and
    hashed for them (`deltamesh.delta.layouts`), so each of their ranks fetches and checks its share."""
    base: tuple[int, Mapping[str, torch.Tensor]] | None = field(default=None, init=False)
    """(version, weights) of the last published version: what the next delta is encoded against."""
    _base_hash: str | None = field(default=None, init=False)
    _base_files: dict[str, str] | None = field(default=None, init=False)
    """name -> digest of the base version's side files, when known: a delta does not re-ship those."""
    link: OriginLink = field(init=False)

    def __post_init__(self) -> None:
        check_publish_numbers(self.full_every, self.piece_bytes, self.connections)
        self.link = OriginLink(self.gateway, self.model_id, self.token, self.tls, self.connections)
        self.gateway, self.token = self.link.gateway, self.link.token

    @classmethod
    def from_settings(cls, settings: PublishSettings, key: Ed25519PrivateKey, **hooks) -> Publisher:
        """The publisher `settings` describe, signing with `key`; `hooks`: on_progress, on_encoded, side_files."""
        return cls(settings.gateway, key, settings.model_id, full_every=settings.full_every,
                   piece_bytes=settings.piece_bytes, connections=settings.connections, token=settings.token,
                   tls=settings.tls, layouts=settings.layouts, **hooks)

    def set_base(self, version: int, weights: Mapping[str, torch.Tensor], weights_hash: str | None = None,
                 side_files: Mapping[str, str] | None = None) -> None:
        """Encode the next delta against `weights` as version `version` (e.g. after a restart).
        `side_files` (name -> digest) are the base version's, if known; else the next delta ships all."""
        self.base, self._base_hash = (version, weights), weights_hash
        self._base_files = dict(side_files) if side_files is not None else None

    def session(self, **kw) -> aiohttp.ClientSession:
        """A new session to the gateway: TLS as configured, the trainer's token on every request."""
        return self.link.session(**kw)

    async def connection(self) -> aiohttp.ClientSession:
        """The session kept open to the origin across versions (`OriginLink.connection`)."""
        return await self.link.connection()

    async def aclose(self) -> None:
        """Close the kept session (the next publish opens a fresh one)."""
        await self.link.aclose()

    async def __aenter__(self) -> "Publisher":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def gateway_head(self) -> int | None:
        return await self.link.head()

    async def publish(self, weights: Mapping[str, torch.Tensor], version: int | None = None) -> Published:
        """Publish `weights` as `version` (default: one after the base, or after the gateway's head).

        `weights` become the base of the next delta, so they must not be changed in place afterwards
        (a trainer passes its bf16 copy, not its live parameters). Once the delta is at the origin the
        version is published and the base moves to it, even if the periodic full then fails.
        """
        if version is None:
            if self.base is not None:
                version = self.base[0] + 1
            else:
                head = await self.gateway_head()
                version = 0 if head is None else head + 1
        if self.base is not None and version <= self.base[0]:
            raise ValueError(f"version {version} is not after the last published {self.base[0]}")
        stages: dict[str, float] = {}
        full_too = self.base is not None and bool(self.full_every) and version % self.full_every == 0
        try:
            session = await self.connection()
            cuts = cuts_for(table_of(weights), self.layouts) if self.layouts else None
            if self.base is not None:
                first = await asyncio.to_thread(
                    encode_delta, self.base[1], weights, model_id=self.model_id, version=version,
                    base_version=self.base[0], key=None, base_hash=self._base_hash,
                    piece_bytes=self.piece_bytes, files=self.side_files, base_files=self._base_files, cuts=cuts)
            else:
                first = await asyncio.to_thread(encode_full, weights, model_id=self.model_id, version=version,
                                                key=None, piece_bytes=self.piece_bytes, files=self.side_files,
                                                cuts=cuts)
            stages["encoded"] = time.time()
            first = first.signed(self.key)
            stages["signed"] = stages["upload_start"] = time.time()
            sent = await self._upload(session, first)
            stages["uploaded"] = time.time()
            # Remembering the hashes spares hashing the base again, and re-shipping its side files.
            self.set_base(version, weights, first.manifest.weights_hash, {f.name: f.hash for f in first.manifest.files})
            await self._put_statement()
            manifests = [first.manifest]
            if full_too:
                full = await asyncio.to_thread(
                    encode_full, weights, model_id=self.model_id, version=version, key=self.key,
                    piece_bytes=self.piece_bytes, files=self.side_files, cuts=cuts,
                    hashes={t.name: t.hash for t in first.manifest.tensors})
                stages["full_encoded"] = time.time()
                sent += await self._upload(session, full)
                stages["full_uploaded"] = time.time()
                manifests.append(full.manifest)
        except HttpError as e:
            await self.link.dropped(e)  # a dropped connection: the next publish connects afresh
            raise
        return Published(version, manifests, sent, stages)

    async def _upload(self, session: aiohttp.ClientSession, enc: Encoded) -> int:
        if self.on_encoded is not None:
            self.on_encoded(enc)
        sent = await upload_version(session, self.gateway, enc.manifest, enc.manifest_bytes, enc.pieces,
                                    connections=self.connections, on_progress=self.on_progress)
        log.info("published %s v%d %s: %d pieces, %d bytes", self.model_id, enc.manifest.version, enc.manifest.kind,
                 len(enc.pieces), enc.manifest.payload_bytes)
        return sent

    async def publish_statement(self) -> bool:
        """Sign and upload a fresh head statement for the last published version (none yet: nothing to
        say, False). A trainer calls this every so often between versions; True once the origin has it."""
        if self.base is None:
            return False
        return await self._put_statement()

    async def _put_statement(self) -> bool:
        version, weights = self.base
        if self._base_hash is None:
            self._base_hash = await asyncio.to_thread(weights_hash, weights)
        return await self.link.put_statement(self.key, version, self._base_hash)


class PublishState:
    """The last published version's weights, number and side-file digests, kept in a directory between
    publishes."""

    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        self.weights_dir = self.dir / "weights"
        self.info_path = self.dir / "published.json"

    def load(self) -> tuple[int, str, dict[str, torch.Tensor]] | None:
        """(version, gateway URL, weights) of the last publish, or None."""
        try:
            info = json.loads(self.info_path.read_text())
        except (OSError, ValueError):
            return None
        if not self.weights_dir.is_dir():
            return None
        return int(info["version"]), str(info["gateway"]), read_weights(self.weights_dir)

    def side_files(self) -> dict[str, str] | None:
        """name -> digest of the last published version's side files (None if not recorded)."""
        try:
            files = json.loads(self.info_path.read_text()).get("side_files")
        except (OSError, ValueError, AttributeError):
            return None
        if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
            return None
        return files

    def save(self, version: int, gateway: str, weights: Mapping[str, torch.Tensor],
             side_files: Mapping[str, str] | None = None) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.info_path.unlink(missing_ok=True)  # no stale number beside new weights if we crash here
        write_weights(self.weights_dir, dict(weights))
        tmp = self.info_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"version": version, "gateway": gateway, "side_files": dict(side_files or {})}))
        os.replace(tmp, self.info_path)


async def publish_dir(publisher: Publisher, weights_dir: str | Path, state: PublishState,
                      version: int | None = None) -> Published:
    """Publish a safetensors directory, continuing from the saved state when it matches the gateway.
    Its side files go with it unless the publisher was given its own."""
    weights = await asyncio.to_thread(read_weights, weights_dir)
    if publisher.side_files is None:
        publisher.side_files = await asyncio.to_thread(read_side_files, weights_dir)
    saved = await asyncio.to_thread(state.load)
    try:
        head = await publisher.gateway_head()
    except HttpError as e:
        raise RuntimeError(f"cannot reach gateway {publisher.gateway}: {e}") from e
    if saved is not None and saved[0] == head and saved[1] == publisher.gateway:
        publisher.set_base(saved[0], saved[2], side_files=state.side_files())
    elif saved is not None:
        log.info("saved state is v%d for %s, gateway head is %s: publishing a full snapshot",
                 saved[0], saved[1], head)
    result = await publisher.publish(weights, version)
    files = {f.name: f.hash for f in result.manifests[0].files}
    await asyncio.to_thread(state.save, result.version, publisher.gateway, weights, files)
    return result
