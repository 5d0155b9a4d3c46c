"""One rank's share of a tensor-parallel engine's weights, and how it takes a version: fetch, verify, apply, load, or put back.

A rank of a tensor- or expert-parallel engine (a vLLM worker) holds a share of each checkpoint tensor
(`deltamesh.delta.layouts`). `RankShare` is that rank's host copy of its share (`HostCopy`: CPU tensors
named as in the model directory, like the whole-model copy `host_weights.py` keeps) with the verified
manifest of the version it holds. Taking a version is two-phase, so that the ranks of one engine agree
before any of them changes what it serves:

1. `prepare`: the rank fetches only the pieces that reach its shares from the gateways, with a fetcher
   of its own (`deltamesh.gateway.fetch.plan_steps.fetch_share`: the trainer-signed manifest first, each piece
   hash-checked against it), decodes them and applies them to its host copy in place, checked against
   the manifest's tiles (`deltamesh.delta.shares.apply_share`), keeping every word it overwrote;
   `stage` instead reads the share of a model directory, checked against the directory's manifest.
   Either runs on a thread of its own (`begin`, `outcome`), so the worker goes on serving the engine;
2. the driver then has every rank `load` the layers whose tensors changed into the engine and `settle`,
   or, when any rank refused the version or failed to load it, every rank `revert`: the kept words are
   written back and the layers it had loaded are loaded again from them.

`loads` hands the engine full-shaped checkpoint tensors whose rank's share holds the values, so that
the engine's own loader narrows each to the share it holds (fused parameters, vocabulary padding and
repacking included); a share of rows lives in such a tensor from the start, so it is handed without a
copy. Nothing here knows vLLM: the worker extension (vllm_rank_worker.py) drives it, and a
weight-transfer plugin in the same worker could too. Messages to and from the driver are plain
JSON-able data (`RankStep`, `RankReport`): no tensor and no pickled object crosses between processes.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from deltamesh.config import from_dict, to_dict
from deltamesh.delta import (
    BaseMismatchError,
    CodecError,
    CorruptError,
    Manifest,
    dir_manifest,
    load_public_key,
    tensor_digest,
)
from deltamesh.delta.dtypes import torch_dtype
from deltamesh.delta.layouts import PoolLayout, shares_of
from deltamesh.delta.parts import TensorSpec
from deltamesh.delta.patch import Rollback
from deltamesh.delta.share_plan import Share
from deltamesh.delta.shares import apply_share, check_share, decode_pieces, read_shares, share_tiles
from deltamesh.gateway.fetch.fetcher import Fetcher
from deltamesh.gateway.fetch.judge import FetchError
from deltamesh.gateway.fetch.plan_steps import fetch_share
from deltamesh.gateway.fetch.sources import Source
from deltamesh.gateway.plan import PlanStep
from deltamesh.http import bearer, client_session
from deltamesh.mesh.pool.sync_config import WeightSyncSettings

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankStep:
    """What the driver asks every rank to take: one step of a transfer plan, and how to reach the gateways."""

    model: str
    step: PlanStep
    sync: WeightSyncSettings
    peer: str
    """Who the ranks are to the gateways (`pool/NAME`); each adds `/rankN`."""

    def body(self) -> dict[str, Any]:
        return {"model": self.model, "step": self.step.to_json(), "sync": to_dict(self.sync), "peer": self.peer}

    @classmethod
    def from_body(cls, raw: Mapping[str, Any]) -> "RankStep":
        return cls(str(raw["model"]), PlanStep.from_json(raw["step"]), from_dict(WeightSyncSettings, raw["sync"]),
                   str(raw["peer"]))


@dataclass
class RankReport:
    """A rank's answer to one call: whether it did it, why not (`kind` names the error's class), and what
    it took."""

    rank: int
    ok: bool = True
    error: str = ""
    kind: str = ""
    """"corrupt" (a piece or the result did not verify), "base" (the version does not apply to what the
    rank holds), "fetch" (no gateway served it in time), "codec" (any other codec refusal), or "error"."""
    version: int = -1
    weights_hash: str = ""
    payload_bytes: int = 0
    """The whole version's piece bytes."""
    fetched_bytes: int = 0
    """The piece bytes this rank fetched (its shares' pieces only)."""
    pieces: int = 0
    changed: int = 0
    """Tensors of the rank's shares that the version wrote into."""
    fetch_s: float = 0.0
    apply_s: float = 0.0
    load_s: float = 0.0
    done: bool = True
    """False while work the rank began (`RankShare.begin`) still runs."""

    def body(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_body(cls, raw: Mapping[str, Any]) -> "RankReport":
        return cls(**raw)

    @classmethod
    def failed(cls, rank: int, error: BaseException) -> "RankReport":
        return cls(rank, ok=False, error=f"{type(error).__name__}: {error}", kind=error_kind(error))


def error_kind(error: BaseException) -> str:
    if isinstance(error, BaseMismatchError):
        return "base"
    if isinstance(error, CorruptError):
        return "corrupt"
    if isinstance(error, FetchError):
        return "fetch"
    return "codec" if isinstance(error, CodecError) else "error"


@dataclass
class HostCopy:
    """A rank's host copy of its share: name -> contiguous CPU slice. A slice of rows is a view of the
    rows of a full-shaped `frame`, which is what the engine is handed (no copy on the way); the frame's
    other rows are never written, so the allocator's fresh pages behind them are not backed by memory.
    A slice of columns is copied into a full-shaped tensor when the engine takes it."""

    slices: dict[str, torch.Tensor]
    frames: dict[str, torch.Tensor]

    @classmethod
    def framed(cls, table: Mapping[str, TensorSpec], shares: Mapping[str, Share],
               slices: Mapping[str, torch.Tensor]) -> "HostCopy":
        out, frames = dict(slices), {}
        for name, share in shares.items():
            if share.dim == 0:
                frames[name] = torch.empty(table[name].shape, dtype=slices[name].dtype)
                out[name] = share.take(frames[name])
                out[name].copy_(slices[name])
        return cls(out, frames)

    def handed(self, spec: TensorSpec, share: Share, name: str) -> torch.Tensor:
        """A tensor of the checkpoint's whole shape whose `share` holds this copy's values of `name`."""
        if share.dim is None:
            return self.slices[name]
        frame = self.frames.get(name)
        if frame is None:
            frame = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
            share.take(frame).copy_(self.slices[name])
        return frame


@dataclass
class _Pending:
    """A version a rank has prepared and not yet settled or reverted."""

    manifest: Manifest | None
    changed: list[str]
    rollback: Rollback | None = None
    """Words the in-place apply overwrote (None for a staged directory)."""
    replacement: HostCopy | None = None
    """A new host copy read from a directory (None for an in-place apply)."""
    loaded: bool = False
    """Whether the engine was asked to load it (so a revert loads the previous values again)."""


class RankShare:
    """One rank's host copy of its share (see the module docstring)."""

    def __init__(self, layout: PoolLayout, rank: int, table: list[TensorSpec], shares: dict[str, Share],
                 slices: Mapping[str, torch.Tensor], held: Manifest | None) -> None:
        self.layout, self.rank = layout, rank
        self.table = {spec.name: spec for spec in table}
        self.shares = shares
        self.host = HostCopy.framed(self.table, shares, slices)
        self.held = held
        """The verified manifest of the version the slices hold (None: not known, so only a full applies)."""
        self._pending: _Pending | None = None
        self._work: threading.Thread | None = None
        self._outcome: RankReport | BaseException | None = None

    @property
    def slices(self) -> dict[str, torch.Tensor]:
        """name -> this rank's slice of the tensor, as the host copy holds it."""
        return self.host.slices

    @classmethod
    def read(cls, directory: str | Path, layout: PoolLayout, rank: int) -> "RankShare":
        """The share of `rank` in model directory `directory`, checked against its manifest if it has one."""
        held, table, shares, slices = _read_checked(directory, layout, rank, None)
        return cls(layout, rank, table, shares, slices, held)

    @property
    def version(self) -> int | None:
        return None if self.held is None else self.held.version

    # -- phase one ---------------------------------------------------------------------------------
    def prepare(self, step: RankStep) -> RankReport:
        """Fetch, verify and apply `step` to the host copy (see the module docstring); raises on refusal
        with the copy as it was."""
        self._check_idle()
        started = time.perf_counter()
        manifest, pieces = asyncio.run(self._fetch(step))
        fetched = time.perf_counter()
        updates = decode_pieces(manifest, pieces)
        rollback = Rollback()
        apply_share(manifest, updates, self.slices, self.shares, held=self.held, rollback=rollback)
        index = manifest.tensor_index()
        changed = sorted(name for name in self.shares if updates.get(index[name]))
        self._pending = _Pending(manifest, changed, rollback=rollback)
        return RankReport(self.rank, version=manifest.version, weights_hash=manifest.weights_hash,
                          payload_bytes=manifest.payload_bytes, fetched_bytes=sum(len(p) for p in pieces.values()),
                          pieces=len(pieces), changed=len(changed), fetch_s=fetched - started,
                          apply_s=time.perf_counter() - fetched)

    def stage(self, directory: str | Path, version: int) -> RankReport:
        """Read this rank's share of model directory `directory` (holding `version`) beside the host copy,
        checked against the directory's manifest when it has one; every tensor counts as changed."""
        self._check_idle()
        started = time.perf_counter()
        held, table, shares, slices = _read_checked(directory, self.layout, self.rank, version)
        if [s.name for s in table] != sorted(self.table) or shares != self.shares:
            raise CorruptError(f"{directory}: its tensors differ from the model's")
        self._pending = _Pending(held, sorted(slices), replacement=HostCopy.framed(self.table, shares, slices))
        return RankReport(self.rank, version=version, weights_hash=held.weights_hash if held is not None else "",
                          changed=len(slices), apply_s=time.perf_counter() - started)

    def begin(self, work: Callable[[], RankReport]) -> None:
        """Run `work` (`prepare` or `stage`) on a thread of its own: the worker goes on serving the engine
        (generation steps) while the rank fetches, verifies and applies; `outcome` tells when it is done."""
        if self._work is not None and self._work.is_alive():
            raise CodecError(f"rank {self.rank} is still taking a version")

        def run() -> None:
            try:
                self._outcome = work()
            except Exception as e:  # noqa: BLE001 - handed to whoever asks for the outcome
                self._outcome = e

        self._outcome = None
        self._work = threading.Thread(target=run, name=f"deltamesh-rank{self.rank}", daemon=True)
        self._work.start()

    def outcome(self) -> RankReport | None:
        """The report of the work `begin` started once it is done (its error raised), None while it runs;
        asked again, the same answer (the driver asks every rank until all are done)."""
        if self._work is None:
            raise CodecError(f"rank {self.rank} has begun nothing")
        if self._work.is_alive():
            return None
        if isinstance(self._outcome, BaseException):
            raise self._outcome
        return self._outcome

    # -- phase two ---------------------------------------------------------------------------------
    @property
    def prepared(self) -> Manifest | None:
        """The verified manifest of the version prepared and not yet settled or reverted (None: none, or a
        directory without one)."""
        return None if self._pending is None else self._pending.manifest

    def changed(self) -> list[str]:
        """The tensors of the prepared version that the engine must take (with their layers' others)."""
        return [] if self._pending is None else list(self._pending.changed)

    def loading(self) -> None:
        """The engine is being handed the prepared version: a revert must load the previous values again."""
        if self._pending is not None:
            self._pending.loaded = True

    def loads(self, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full-shaped tensor) for each of `names` this rank holds, made as the engine reads them,
        its share holding the values of the prepared version (if any) or of the host copy."""
        pending = self._pending
        current = pending.replacement if pending is not None and pending.replacement is not None else self.host
        return ((name, current.handed(self.table[name], self.shares[name], name)) for name in names if name in self.shares)

    def settle(self) -> None:
        """The prepared version is the one served: the host copy and its manifest move to it."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.replacement is not None:
            self.host = pending.replacement
        self.held = pending.manifest

    def revert(self) -> list[str]:
        """Put the host copy back as it was before the prepared version (after the work `begin` started,
        if it still runs, has ended); returns the tensors the engine must load again (those it was asked
        to load), or none."""
        if self._work is not None:
            self._work.join()
            self._work, self._outcome = None, None
        pending, self._pending = self._pending, None
        if pending is None:
            return []
        if pending.rollback is not None:
            pending.rollback.restore()
        return pending.changed if pending.loaded else []

    # -- checks ------------------------------------------------------------------------------------
    def proofs(self, served: Mapping[str, torch.Tensor | None], names: list[str]) -> dict[str, dict | None]:
        """What this rank can show of each of `names` it holds, from `served` (name -> what the engine
        holds of its share): {"whole": digest} of a tensor held whole, {"tiles": {index: digest}} of the
        tiles of the held version's hash grid that a share covers, None where neither can be shown."""
        entries = {t.name: t for t in self.held.tensors} if self.held is not None else {}
        out: dict[str, dict | None] = {}
        for name in (n for n in names if n in self.shares):
            t, share, entry = served.get(name), self.shares[name], entries.get(name)
            out[name] = None
            if t is None:
                continue
            if share.dim is None:
                out[name] = {"whole": tensor_digest(t.contiguous(), entry.grid if entry is not None else None)}
            elif entry is not None:
                try:
                    out[name] = {"tiles": {str(i): d for i, d in share_tiles(entry, share, t.contiguous()).items()}}
                except CodecError:  # the version has no tiles for this share
                    pass
        return out

    def _check_idle(self) -> None:
        if self._pending is not None:
            raise CodecError(f"rank {self.rank} has a version prepared and not settled")

    async def _fetch(self, step: RankStep) -> tuple[Manifest, dict[int, bytes]]:
        sync = step.sync
        keys = [load_public_key(path) for path in sync.trusted_keys]
        async with client_session(connections=sync.connections + 2, timeout_s=None, tls=sync.tls,
                                  headers=bearer(sync.token) if sync.token else None) as session:
            fetcher = Fetcher(session, [Source(url) for url in sync.gateways], f"{step.peer}/rank{self.rank}",
                              stall_timeout_s=sync.stall_timeout_s, give_up_s=sync.give_up_s,
                              penalty_s=min(sync.stall_timeout_s, 5.0))
            return await fetch_share(fetcher, step.model, step.step, keys, sync.connections, self.shares)


def _read_checked(directory: str | Path, layout: PoolLayout, rank: int, version: int | None
                  ) -> tuple[Manifest | None, list[TensorSpec], dict[str, Share], dict[str, torch.Tensor]]:
    held = dir_manifest(directory)
    if held is not None and version is not None and held.version != version:
        raise BaseMismatchError(f"{directory} holds v{held.version}, v{version} was asked for")
    table, shares, slices = read_shares(directory, lambda table: shares_of(table, layout, rank))
    if held is None:
        return None, table, shares, slices
    entries = {t.name: t for t in held.tensors}
    if set(entries) != {spec.name for spec in table}:
        raise CorruptError(f"{directory}: tensors differ from its manifest")
    for name, share in shares.items():
        try:
            ok = check_share(entries[name], share, slices[name])
        except CodecError as e:  # a version published without this layout's cuts: no tiles for the share
            log.warning("%s: rank %d cannot check its share alone (%s); it takes a full snapshot next", directory, rank, e)
            return None, table, shares, slices
        if not ok:
            raise CorruptError(f"{directory}: rank {rank}'s share of {name!r} does not match its manifest")
    return held, table, shares, slices
