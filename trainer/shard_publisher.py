"""One trainer rank's publisher of versions built in parts: its own rows encoded, staged and described.

Every rank of a sharded trainer holds some rows of each tensor (its FSDP2 shard). For each version
every rank, at once, with its own cores and its own connections to the origin:

1. encodes the rows it holds against the same rows of the last version it published (a full snapshot
   of them for the first version, or when the base is gone), hashing them tile by tile
   (`deltamesh.delta.parts.encode_part`); the pool layouts' `cuts` say where pool ranks' shares end;
2. stages its pieces on the origin (`deltamesh.trainer.upload.stage_pieces`: checked there, not yet
   part of any version);
3. puts its part's description (a few bytes per piece and tile, JSON) on the exchange (exchange.py).

Rank 0 then gathers every description, assembles the tensor and piece tables
(`deltamesh.delta.assemble`), signs one manifest, and sends it with `?staged=1`: the origin takes it
only when every piece is staged, so the version is announced whole or not at all (a rank that died
never described its part: rank 0 gives up after `part_timeout_s` and nothing is announced). Rank 0
puts the outcome on the exchange, and every rank moves its base to the new rows once the version is
published. A periodic full snapshot (every `full_every` versions) follows the same way, its tiles
taken from the delta's. No rank ever holds more than its base rows, its new rows and its pieces.
Rank 0 also signs the head statement. A rank that is not rank 0 needs no key.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import KW_ONLY, dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from deltamesh.delta import CodecError
from deltamesh.delta.assemble import assemble
from deltamesh.delta.cuts import Cuts, TensorSpec
from deltamesh.delta.encode import manifest_of_parts, shipped_files
from deltamesh.delta.keys import Ed25519PrivateKey
from deltamesh.delta.manifest import Kind, Manifest
from deltamesh.delta.parts import Part, encode_part
from deltamesh.gateway.config import DEFAULT_PIECE_BYTES
from deltamesh.http import HttpError
from deltamesh.tls import TlsSettings
from deltamesh.trainer.exchange import PartExchange
from deltamesh.trainer.origin_link import OriginLink
from deltamesh.trainer.publish_settings import PublishSettings, check_publish_numbers
from deltamesh.trainer.publisher import Published
from deltamesh.trainer.upload import put_staged_manifest, stage_pieces

log = logging.getLogger(__name__)

Rows = Mapping[str, tuple[int, int]]
"""Tensor name -> the rows [start, stop) of dim 0 this rank holds (a tensor not named: held whole)."""


class PartsError(Exception):
    """A version built in parts was not published (a rank did not describe its part in time, or rank 0
    could not assemble or send it): nothing of it is announced."""


@dataclass(eq=False, repr=False)
class ShardPublisher:
    gateway: str
    model_id: str
    exchange: PartExchange
    _: KW_ONLY
    key: Ed25519PrivateKey | None = None
    """The trainer's signing key: rank 0's (the other ranks sign nothing)."""
    full_every: int = 10
    piece_bytes: int = DEFAULT_PIECE_BYTES
    connections: int = 4
    token: str | None = None
    tls: TlsSettings | None = None
    side_files: Mapping[str, bytes] | None = None
    """The model directory's side files (rank 0 ships them)."""
    cuts: Mapping[str, Cuts] | None = None
    part_timeout_s: float = 300.0
    """How long rank 0 waits for every rank's part (the others wait twice as long for its outcome)."""
    on_encoded: Callable[[], None] | None = None
    """Called once this rank has encoded its part of a version (its upload goes on)."""
    base: tuple[int, Mapping[str, torch.Tensor]] | None = field(default=None, init=False)
    """(version, rows held) of the last published version: what this rank's next part is encoded against."""
    link: OriginLink = field(init=False)
    _base_hash: str | None = field(default=None, init=False)
    _base_files: dict[str, str] | None = field(default=None, init=False)
    _calls: int = field(default=0, init=False)
    """Publishes begun: every rank begins the same ones in the same order, so it names their exchange keys."""
    _spent: list[str] = field(default_factory=list, init=False)
    """Rank 0: exchange keys of the last publish, forgotten once every rank has moved past it."""

    def __post_init__(self) -> None:
        check_publish_numbers(self.full_every, self.piece_bytes, self.connections)
        if self.exchange.rank == 0 and self.key is None:
            raise ValueError("rank 0 signs every version: it needs the trainer's key")
        self.link = OriginLink(self.gateway, self.model_id, self.token, self.tls, self.connections)

    @classmethod
    def from_settings(cls, settings: PublishSettings, exchange: PartExchange, **rest) -> ShardPublisher:
        """This rank's publisher as `settings` describe; `rest`: key (rank 0's), side_files, cuts, hooks."""
        return cls(settings.gateway, settings.model_id, exchange, full_every=settings.full_every,
                   piece_bytes=settings.piece_bytes, connections=settings.connections, token=settings.token,
                   tls=settings.tls, **rest)

    @property
    def rank(self) -> int:
        return self.exchange.rank

    @property
    def published_hash(self) -> str | None:
        """Rank 0: the weights hash of the last version published (what the next delta's base is)."""
        return self._base_hash

    async def aclose(self) -> None:
        await self.link.aclose()

    async def publish_statement(self) -> bool:
        """Rank 0: sign and upload a fresh head statement for the last published version (between
        versions, so pools that require fresh statements see the trainer is alive); False elsewhere."""
        if self.rank != 0 or self.base is None or self._base_hash is None:
            return False
        return await self.link.put_statement(self.key, self.base[0], self._base_hash)

    async def publish(self, table: Sequence[TensorSpec], weights: Mapping[str, torch.Tensor], rows: Rows,
                      version: int) -> Published:
        """Publish, as `version`, the version whose tensors are `table` from every rank at once, this rank
        giving the `rows` it holds (`weights`: its bf16 copy of them, kept as the next base: never change
        it in place afterwards). Every rank calls this with the same `table` and `version`."""
        if self.base is not None and version <= self.base[0]:
            raise ValueError(f"version {version} is not after the last published {self.base[0]}")
        stages: dict[str, float] = {}
        self._calls += 1
        base = self.base[1] if self.base is not None else None
        kind: Kind = "delta" if base is not None else "full"
        try:
            part, sent, manifest = await self._publish_part(table, weights, base, rows, version, kind, stages)
            # The old base is dropped before a full snapshot is encoded: at most two copies of the rows.
            self.base, base = (version, weights), None
            manifests = [manifest] if manifest is not None else []
            if kind == "delta" and self.full_every and version % self.full_every == 0:
                known = {table[h.index].name: h.tiles for h in part.held}
                _, more, full = await self._publish_part(table, weights, None, rows, version, "full", stages,
                                                         known=known, prefix="full_")
                sent += more
                manifests += [full] if full is not None else []
        except HttpError as e:
            await self.link.dropped(e)
            raise
        return Published(version, manifests, sent, stages)

    async def _publish_part(self, table: Sequence[TensorSpec], weights: Mapping[str, torch.Tensor],
                            base: Mapping[str, torch.Tensor] | None, rows: Rows, version: int, kind: Kind,
                            stages: dict[str, float], *, known: Mapping[str, tuple[str, ...]] | None = None,
                            prefix: str = "") -> tuple[Part, int, Manifest | None]:
        """Encode, stage and describe this rank's part of (version, kind); rank 0 assembles and sends the
        manifest. Returns the part, the bytes this rank sent, and (rank 0) the manifest."""
        part = await asyncio.to_thread(encode_part, table, weights, base=base, rows=rows, cuts=self.cuts,
                                       piece_bytes=self.piece_bytes, known=known)
        stages[prefix + "encoded"] = time.time()
        if self.on_encoded is not None and not prefix:
            self.on_encoded()
        session = await self.link.connection()
        stages[prefix + "upload_start"] = time.time()
        sent = await stage_pieces(session, self.link.gateway, self.model_id, [p.data for p in part.pieces],
                                  [p.digest for p in part.pieces], connections=self.connections)
        stages[prefix + "staged"] = time.time()
        key = f"{self.model_id}/{self._calls}/v{version}/{kind}"
        self.exchange.put(f"{key}/part/{self.rank}", json.dumps(part.describe()).encode())
        if self.rank != 0:
            try:
                # Rank 0 waits up to part_timeout_s for the parts, then assembles, signs and sends.
                raw = await asyncio.to_thread(self.exchange.get, f"{key}/outcome", 2 * self.part_timeout_s)
            except TimeoutError as e:
                raise PartsError(f"rank 0 told no outcome of {self.model_id} v{version} {kind}") from e
            outcome = json.loads(raw)
            if not outcome["ok"]:
                raise PartsError(f"{self.model_id} v{version} {kind} was not published: {outcome['error']}")
            stages[prefix + "uploaded"] = time.time()
            return part, sent, None
        try:
            manifest, sent_files = await self._sign_and_send(table, version, kind, key, session, stages, prefix)
        except (PartsError, CodecError, HttpError, TimeoutError) as e:
            self.exchange.put(f"{key}/outcome", json.dumps({"ok": False, "error": str(e)}).encode())
            raise
        self.exchange.put(f"{key}/outcome", json.dumps({"ok": True, "weights_hash": manifest.weights_hash}).encode())
        return part, sent + sent_files, manifest

    async def _sign_and_send(self, table: Sequence[TensorSpec], version: int, kind: Kind, key: str, session,
                             stages: dict[str, float], prefix: str) -> tuple[Manifest, int]:
        """Rank 0: every rank's part, assembled, signed and sent; the head statement after a first kind."""
        descriptions = []
        for r in range(self.exchange.world):
            try:
                raw = await asyncio.to_thread(self.exchange.get, f"{key}/part/{r}", self.part_timeout_s)
            except TimeoutError as e:
                raise PartsError(f"rank {r} did not describe its part of {self.model_id} v{version} {kind} "
                                 f"within {self.part_timeout_s:g} s") from e
            descriptions.append(json.loads(raw))
        # Every rank has described its part of this publish, so each has read the last one's outcome.
        for spent in self._spent:
            self.exchange.delete(spent)
        self._spent = [f"{key}/part/{r}" for r in range(self.exchange.world)] + [f"{key}/outcome"]
        assembled = await asyncio.to_thread(assemble, table, descriptions)
        files = dict(self.side_files or {})
        manifest = manifest_of_parts(assembled, model_id=self.model_id, version=version,
                                     base_version=self.base[0] if kind == "delta" and self.base else None,
                                     base_hash=self._base_hash if kind == "delta" else None, files=files,
                                     base_files=self._base_files if kind == "delta" else None, kind=kind)
        if kind == "delta" and self._base_hash is None:
            raise PartsError(f"{self.model_id} v{version}: the base's weights hash is unknown; publish a full snapshot")
        envelope = manifest.signed(self.key)
        stages[prefix + "signed"] = time.time()
        # Side files are rank 0's: staged like every other piece before the manifest claims them.
        side = shipped_files(manifest, files)
        sent = await stage_pieces(session, self.link.gateway, self.model_id, side,
                                  [manifest.pieces[f.piece].hash for f in sorted(manifest.file_pieces().values(),
                                                                                  key=lambda f: f.piece)],
                                  connections=self.connections)
        await put_staged_manifest(session, self.link.gateway, manifest, envelope)
        stages[prefix + "uploaded"] = time.time()
        log.info("published %s v%d %s in %d parts: %d pieces, %d bytes", self.model_id, version, kind,
                 len(descriptions), len(manifest.pieces), manifest.payload_bytes)
        if not prefix:
            self._base_hash = manifest.weights_hash
            self._base_files = {f.name: f.hash for f in manifest.files}
            await self.link.put_statement(self.key, version, manifest.weights_hash)
        return manifest, sent
