"""Fetching one step of a transfer plan, verified: the trainer-signed manifest, then its hash-checked pieces.

The one way a version's bytes are taken from gateways, for a pool's weight sync and for a trainer
that rebuilds the gateway's weights at start-up alike: the manifest must be signed by a trusted key
and name exactly the model, version and kind the plan asked for (a relay cannot substitute another
version), and every piece is checked against the manifest by the fetcher before it is kept. A pool
adds its own `check` of the manifest (no rollback, one weights hash per version: see
`deltamesh.mesh.pool.head_check`); a manifest it refuses is, to the fetcher, one more it cannot accept,
so the fetcher turns to another gateway for it.
"""

from __future__ import annotations

from typing import Awaitable, Callable, Mapping, Sequence

from deltamesh.delta import CorruptError, Manifest, load_manifest
from deltamesh.delta.keys import Ed25519PublicKey
from deltamesh.delta.share_plan import Share, pieces_for
from deltamesh.gateway.fetch.fetcher import Fetcher, Inline
from deltamesh.gateway.fetch.parts import EarlyParts
from deltamesh.gateway.fetch.sources import Source
from deltamesh.gateway.plan import PlanStep

Step = tuple[Manifest, list[bytes]]


async def fetch_verified(fetcher: Fetcher, model: str, step: PlanStep, trusted_keys: Sequence[Ed25519PublicKey],
                         connections: int, on_piece: Callable[[int], None] | None = None,
                         check: Callable[[Manifest], None] | None = None, inline: Inline | None = None,
                         parts: EarlyParts | None = None) -> Step:
    """The verified manifest and pieces of `step`; raises FetchError or CodecError (CorruptError).
    `check` may refuse a validly signed manifest by raising a CodecError. `inline`: the step's envelope
    as a head answer carried it, checked the same way (and fetched as usual if it is refused). `parts`:
    parts of a version asked for before it was known (`Fetcher.ask_parts`), which carry the pieces
    (of this step's version, if they are of it) instead of the manifest request's prefetch; parts of
    another kind are closed unused."""

    accept = _acceptor(model, step, trusted_keys, check)
    if parts is not None and (parts.model, parts.kind) != (model, step.kind):
        await parts.close()
        parts = None
    try:
        manifest = await fetcher.manifest_bytes(model, step.version, step.kind, accept,
                                                prefetch=0 if parts is not None else connections, inline=inline)
    except BaseException:
        if parts is not None:
            parts.cancel()
        raise
    pieces: list[bytes] = [b""] * len(manifest.pieces)

    async def keep(index: int, data: bytes) -> None:
        pieces[index] = data
        if on_piece is not None:
            on_piece(len(data))

    await fetcher.pieces(manifest, range(len(pieces)), connections, keep, parts)
    return manifest, pieces


async def fetch_share(fetcher: Fetcher, model: str, step: PlanStep, trusted_keys: Sequence[Ed25519PublicKey],
                      connections: int, shares: Mapping[str, Share],
                      check: Callable[[Manifest], None] | None = None) -> tuple[Manifest, dict[int, bytes]]:
    """A pool rank's part of `step`: the verified manifest, and only the pieces that reach its `shares`
    (tensor name -> the slice it holds: `deltamesh.delta.shares.pieces_for`), each hash-checked. Nothing
    is asked for ahead of the manifest, so no byte outside the rank's shares is requested."""

    accept = _acceptor(model, step, trusted_keys, check)
    manifest = await fetcher.manifest_bytes(model, step.version, step.kind, accept, prefetch=0)
    pieces: dict[int, bytes] = {}

    async def keep(index: int, data: bytes) -> None:
        pieces[index] = bytes(data)

    await fetcher.pieces(manifest, pieces_for(manifest, shares), connections, keep)
    return manifest, pieces


def _acceptor(model: str, step: PlanStep, trusted_keys: Sequence[Ed25519PublicKey],
              check: Callable[[Manifest], None] | None) -> Callable[[bytes], Awaitable[Manifest]]:
    """What takes a fetched envelope: its signature verified, and it must name exactly the step asked for."""

    async def accept(raw: bytes) -> Manifest:
        m = load_manifest(raw, trusted_keys)
        if (m.model_id, m.version, m.kind) != (model, step.version, step.kind):
            raise CorruptError(f"gateway sent {m.model_id} v{m.version} {m.kind} for step v{step.version} {step.kind}")
        if check is not None:
            check(m)
        return m

    return accept


def inline_envelopes(source: Source, head: int | None, carried: object) -> dict[tuple[int, str], Inline]:
    """The envelopes a head answer carried (`{kind: envelope}`), by (version, kind); anything malformed
    is ignored (the manifest is then fetched as usual)."""
    if head is None or not isinstance(carried, dict):
        return {}
    return {(head, kind): (source, raw.encode()) for kind, raw in carried.items()
            if isinstance(kind, str) and isinstance(raw, str)}
