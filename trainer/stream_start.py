"""Joining a trainer's weight stream to what the origin gateway already holds, at start or restart.

A trainer starts with weights it can name a version for: the initial model (version 0) or a
checkpoint's master weights (version c, whose bf16 cast is bit-identical to what was published as
c). The gateway may hold nothing for the model yet, exactly version c, less (c's publish was lost
in a crash), or more: versions published after the checkpoint by a run that then crashed, the last
of them perhaps only half uploaded. `start_stream` reads the gateway's version listing and sets the
publisher's base to the newest complete version n, so that the trainer's next version is a delta
the pools can follow:

- n == c with the trainer's hash: the base is the trainer's own weights; nothing is sent.
- n > c: n's weights are rebuilt from the gateway (the delta chain from c when the gateway's c is
  the trainer's, else a full snapshot route) and verified against the signed manifests. The
  trainer's version counter moves to the gateway's head, so numbering never goes backwards, and
  the next version is a delta on n even if a version after n was left incomplete (the plan
  follows `base_version`, so pools skip the incomplete one).
- n < c: the trainer's weights never fully reached the gateway; they are published now, as c (or
  after the head if c is taken by an unfinished upload), as a delta on n's rebuilt weights.
- nothing complete: the weights are published as a full snapshot (finishing an interrupted upload
  of the same snapshot when that is what the gateway holds).

Only when n's weights cannot be obtained or do not fit the model is a full snapshot published
after the head instead, with the reason logged.

A trainer that publishes in parts (each rank its own rows) starts simpler, with `start_sharded`: its
ranks publish their weights as a full snapshot, numbered `version` or after the gateway's head, which
is always a valid plan for every pool (no rank holds the whole model to compare with the gateway's).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from deltamesh.delta import CodecError, apply, weights_hash
from deltamesh.delta.keys import Ed25519PublicKey
from deltamesh.gateway.fetch.fetcher import Fetcher, FetchError
from deltamesh.gateway.fetch.plan_steps import fetch_verified
from deltamesh.gateway.fetch.sources import Source
from deltamesh.gateway.plan import Plan
from deltamesh.gateway_client import GatewayClient
from deltamesh.http import HttpError
from deltamesh.trainer.origin_link import OriginLink
from deltamesh.trainer.publisher import Published, Publisher

log = logging.getLogger(__name__)


@dataclass
class StreamStart:
    """Where the trainer's weight stream stands after `start_stream`.

    `version` is the trainer's version counter from now on (its next version is `version + 1`);
    `base_version` is the gateway version the next delta is encoded against; `published` is the
    full snapshot published at start, if one was needed; `reason` says which case applied.
    """

    version: int
    base_version: int
    published: Published | None
    reason: str


async def model_versions(publisher: Publisher) -> dict[str, Any] | None:
    """The gateway's listing of the publisher's model's versions (`GET .../versions`), or None if it has none."""
    async with publisher.session(timeout_s=30.0) as s:
        try:
            return await GatewayClient(publisher.gateway, s, peer=f"trainer/{publisher.model_id}").versions(
                publisher.model_id)
        except HttpError as e:
            if e.status == 404:
                return None
            raise


async def start_stream(
    publisher: Publisher,
    version: int,
    weights: Mapping[str, torch.Tensor],
    trusted_keys: Sequence[Ed25519PublicKey],
) -> StreamStart:
    """Set `publisher`'s base from the gateway's state, publishing only what the gateway lacks.

    `weights` are the trainer's current bf16 weights, which it holds as `version`. Raises HttpError
    only when the gateway cannot be reached at all.
    """
    ours = weights_hash(weights)
    listing = await model_versions(publisher)
    if listing is None:
        return await _publish_full(publisher, version, weights, "the gateway holds no version of this model yet")
    head = int(listing["head"])
    complete = {int(e["version"]): str(e["weights_hash"]) for e in listing["versions"] if e["complete"]}
    newest = max(complete, default=None)
    if newest is None:
        # Only unfinished uploads: finish ours if it is one, else number past them.
        at = version if head < version or (head == version and _our_full_at(listing, version, ours)) else head + 1
        return await _publish_full(publisher, at, weights, "the gateway holds no complete version")
    if newest == version and complete[version] == ours:
        publisher.set_base(version, weights, ours)
        return StreamStart(head, version, None, f"the gateway holds v{version} as the trainer does")
    have = (version, weights) if version < newest and complete.get(version) == ours else None
    try:
        base = await gateway_weights(publisher, newest, trusted_keys, have=have)
        _check_fit(base, weights)
    except (CodecError, FetchError, HttpError, ValueError) as e:
        return await _publish_full(publisher, max(head + 1, version), weights,
                                   f"cannot take the gateway's v{newest} as the base of the next delta: {e}")
    publisher.set_base(newest, base, complete[newest])
    how = "its delta chain from the trainer's" if have is not None else "a full snapshot route, not from the trainer's"
    if newest >= version:
        return StreamStart(head, newest, None, f"the gateway is at v{head} (newest complete v{newest}), "
                                               f"rebuilt by {how} v{version}")
    # The trainer's weights are not at the gateway (their publish was lost): publish them, as a delta.
    at = max(head + 1, version)
    log.info("%s: publishing the trainer's v%d as v%d, a delta on the gateway's v%d", publisher.model_id,
             version, at, newest)
    published = await publisher.publish(weights, at)
    return StreamStart(at, at, published, f"the gateway's newest complete version is v{newest}; "
                                          f"published the trainer's weights as v{at}")


async def start_sharded(link: OriginLink, version: int) -> int:
    """The version a trainer that publishes in parts starts its stream at (a full snapshot of the
    trainer's `version`): `version` itself, or one past the gateway's head if that is not below it."""
    head = await link.head()
    at = version if head is None or head < version else head + 1
    log.info("%s: every rank publishes its rows of v%d as v%d, a full snapshot (the gateway's head: %s)",
             link.model_id, version, at, head)
    return at


def _our_full_at(listing: dict[str, Any], version: int, ours: str) -> bool:
    """Whether the gateway holds (maybe half-uploaded) a full snapshot of exactly our weights at `version`."""
    return any(e["version"] == version and e["kind"] == "full" and e["weights_hash"] == ours
               for e in listing["versions"])


def _check_fit(base: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor]) -> None:
    """A base of another architecture cannot carry a delta to `weights`."""
    if {n: (tuple(t.shape), t.dtype) for n, t in base.items()} != {
        n: (tuple(t.shape), t.dtype) for n, t in weights.items()
    }:
        raise ValueError("its tensors differ in names, shapes or dtypes from the trainer's")


async def _publish_full(publisher: Publisher, version: int, weights: Mapping[str, torch.Tensor],
                        reason: str) -> StreamStart:
    log.info("%s: publishing v%d as a full snapshot (%s)", publisher.model_id, version, reason)
    publisher.base = None
    published = await publisher.publish(weights, version)
    return StreamStart(version, version, published, reason)


async def gateway_weights(
    publisher: Publisher,
    version: int,
    trusted_keys: Sequence[Ed25519PublicKey],
    *,
    have: tuple[int, Mapping[str, torch.Tensor]] | None = None,
    connections: int = 4,
    give_up_s: float = 60.0,
) -> dict[str, torch.Tensor]:
    """The weights of `version` as the publisher's gateway holds them, rebuilt from its verified versions.

    With `have` (a version and its weights), the gateway's plan from there is followed (usually a
    short delta chain); without, a full snapshot route. Every manifest is checked against
    `trusted_keys` and every result tensor against its hash, so the weights are bit-exact.
    """
    model_id = publisher.model_id
    async with publisher.session(connections=2 * connections + 4, timeout_s=None) as session:
        client = GatewayClient(publisher.gateway, session, peer=f"trainer/{model_id}")
        params = {"from": None if have is None else have[0], "to": version}
        plan = Plan.from_json(await client.plan(model_id, params))
        fetcher = Fetcher(session, [Source(client.base)], f"trainer/{model_id}", give_up_s=give_up_s)
        weights: Mapping[str, torch.Tensor] | None = None if have is None else have[1]
        for step in plan.steps:
            manifest, pieces = await fetch_verified(fetcher, model_id, step, trusted_keys, connections)
            weights = await asyncio.to_thread(apply, weights if manifest.kind == "delta" else None, manifest, pieces)
        log.info("%s: rebuilt the gateway's v%d (%s, %d steps, %d bytes)", model_id, version, plan.reason,
                 len(plan.steps), plan.payload_bytes)
    if weights is None:
        raise FetchError(f"{model_id}: the gateway's plan to v{version} is empty")
    return dict(weights)
