"""vLLM over tensor- or expert-parallel ranks, each rank taking its own share of every version.

`VLLMRanksEngine` is the vLLM engine of vllm_engine.py (generation stepped in this process, updates
between two engine steps) with `tensor_parallel_size` ranks in worker processes (vLLM's multiprocessing
executor) that carry the `RankWorker` extension (vllm_rank_worker.py). No process holds the whole model
for updates: each rank keeps a host copy of its own share (`RankShare`), and `take_step` moves the
engine to one step of a transfer plan in two phases:

1. every rank fetches from the gateways only the pieces that reach its share (its own fetcher), verifies
   them against the trainer-signed manifest and applies them to its host copy, checked against the
   manifest's tiles;
2. only when every rank did, and all name the same signed weights hash, does every rank hand the
   layers it changed to vLLM's in-place reload, between two engine steps, and settle.

A version any rank refuses (a tampered piece, a wrong base, no gateway serving it) makes every rank put
its host copy back, and vLLM is never touched: the engine serves what it served, bit for bit, and the
error is raised as the class the rank named (CorruptError, BaseMismatchError, FetchError). A failure
inside vLLM's reload makes every rank load its previous values again; if even that fails, the engine
refuses to generate until a `load_version` succeeds. `load_version` goes the same way with a model
directory: each rank reads its share of it (checked against the directory's manifest tiles) and vLLM
reloads the files.

A version decoded in the pool's own process cannot reach the workers by reference, so `apply_update`
is refused and `supports_in_place` is False: the pool's weight stream today persists each version to
its directory and reloads from it; a stream that drives `take_step` instead moves the engine without
the pool process fetching, decoding or holding the whole version. `served_digests` proves what vLLM
serves rank by rank: each rank hashes its slices by the tiles of the version's hash grids, and the
tiles of all ranks make up each tensor's digest.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Sequence

from prometheus_client import CollectorRegistry

from deltamesh.delta import BaseMismatchError, CodecError, CorruptError, DecodedVersion, Grid, Manifest
from deltamesh.delta.hashing import combine_digests
from deltamesh.delta.layouts import PoolLayout
from deltamesh.gateway.fetch.judge import FetchError
from deltamesh.gateway.plan import PlanStep
from deltamesh.mesh.engines.base import EngineError, ServedDigests
from deltamesh.mesh.engines.vllm_engine import VLLMEngine, VLLMEngineConfig
from deltamesh.mesh.engines.vllm_rank_share import RankReport, RankStep
from deltamesh.mesh.engines.vllm_rank_worker import QUALNAME
from deltamesh.mesh.pool.sync_config import WeightSyncSettings

log = logging.getLogger(__name__)

_BIND = "VLLM_CPU_OMP_THREADS_BIND"
POLL_S = 0.02
"""How often the driver asks the ranks whether the version they are taking is in their host copies."""
_ERRORS: dict[str, type[Exception]] = {"corrupt": CorruptError, "base": BaseMismatchError, "fetch": FetchError,
                                       "codec": CodecError}


@dataclass
class VLLMRanksConfig(VLLMEngineConfig):
    tensor_parallel_size: int = 2
    """vLLM's tensor-parallel ranks (one worker process each)."""
    expert_parallel: bool = False
    """Experts whole per rank (vLLM's `enable_expert_parallel`) instead of a slice of each."""
    cpu_threads_bind: str = ""
    """vLLM's CPU build only: the cores of each rank's threads, ranks separated by "|" (its
    VLLM_CPU_OMP_THREADS_BIND, e.g. "0-3|4-7"); empty: that variable as set, else this process's cores
    dealt evenly over the ranks (vLLM's own default asks for a NUMA node per rank)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        parallel = {"tensor_parallel_size": self.tensor_parallel_size, "distributed_executor_backend": "mp",
                    "worker_extension_cls": QUALNAME, "enable_expert_parallel": self.expert_parallel}
        clash = sorted(k for k, v in parallel.items() if k in self.engine_args and self.engine_args[k] != v)
        if clash:
            raise ValueError(f"engine_args {clash} are set by this config's own settings")
        self.engine_args = {**self.engine_args, **parallel}

    def layout(self, kv_heads: int | None) -> PoolLayout:
        return vllm_layout(self.tensor_parallel_size, self.expert_parallel, kv_heads)


def vllm_layout(tensor_parallel_size: int, expert_parallel: bool, kv_heads: int | None) -> PoolLayout:
    """How vLLM splits a model over `tensor_parallel_size` ranks (experts whole per rank with
    `expert_parallel`), for a model of `kv_heads` key/value heads."""
    tp = tensor_parallel_size
    return PoolLayout(tp=tp, ep=tp if expert_parallel else 1, kv_heads=kv_heads)


def dealt_cores(ranks: int, cores: Sequence[int]) -> str:
    """`cores` dealt evenly over `ranks` in VLLM_CPU_OMP_THREADS_BIND's form (ranks share cores when
    there are fewer cores than ranks)."""
    cores = sorted(cores)
    if len(cores) >= ranks:
        per = len(cores) // ranks
        groups = [cores[r * per:(r + 1) * per] for r in range(ranks)]
    else:
        groups = [[cores[r % len(cores)]] for r in range(ranks)]
    return "|".join(",".join(str(c) for c in group) for group in groups)


class VLLMRanksEngine(VLLMEngine):
    """vLLM over ranks that take their own shares (see the module docstring). Construction starts vLLM
    and blocks."""

    config: VLLMRanksConfig

    def __init__(self, config: VLLMRanksConfig, *, registry: CollectorRegistry | None = None) -> None:
        from vllm import envs
        from vllm.platforms import current_platform

        self._reload_s = 0.0
        before = os.environ.get(_BIND)
        if current_platform.is_cpu():
            # Read by each worker process vLLM starts (without it vLLM wants a NUMA node per rank); set
            # only while they start, so that the next engine of this process deals its own ranks.
            os.environ[_BIND] = (config.cpu_threads_bind or before
                                 or dealt_cores(config.tensor_parallel_size, sorted(os.sched_getaffinity(0))))
        # vLLM caches its environment once an engine has started: this engine's binding must be read afresh.
        envs.disable_envs_cache()
        try:
            super().__init__(config, registry=registry)
        finally:
            if before is None:
                os.environ.pop(_BIND, None)
            else:
                os.environ[_BIND] = before

    def _open_weights(self, manifest: Manifest | None) -> None:
        self.layout = self.config.layout(self._engine.model_config.get_total_num_kv_heads())
        """How the model is split over the ranks: a layout the trainer publishes for (`trainer.pool_layouts`)."""
        agreed(self._reports("deltamesh_open", self.config.model_dir, asdict(self.layout)), None, self.model_id)

    @property
    def supports_in_place(self) -> bool:
        return False

    @property
    def last_reload_s(self) -> float:
        """Seconds the last update spent inside vLLM's reload (the slowest rank's)."""
        return self._reload_s

    async def take_step(self, step: PlanStep, sync: WeightSyncSettings, peer: str) -> list[RankReport]:
        """Move to plan step `step` (a delta onto the version served, or a full snapshot), every rank
        fetching its pieces from `sync`'s gateways as `peer` (`pool/NAME`); the ranks' reports (bytes
        fetched, seconds per phase). On any error every rank still serves what it served."""
        self._check_serving()
        request = RankStep(self.model_id, step, sync, peer).body()
        return await self._swap(("deltamesh_prepare", request), ("deltamesh_load",), step.kind, step.version)

    async def load_version(self, path: Any, version: int) -> None:
        """Every rank reads its share of model directory `path` (checked against its manifest's tiles when
        it has one), then vLLM reloads every layer from the files."""
        self._check_open()
        await self._swap(("deltamesh_stage", str(path), version), ("deltamesh_reload_dir", str(path)), "disk", version)
        log.info("%s: now serving v%d from %s on %d ranks", self.model_id, version, path, self.layout.ranks)

    async def apply_update(self, version: DecodedVersion) -> None:
        raise EngineError(f"{self.model_id}: a tensor-parallel engine takes versions rank by rank (take_step) "
                          "or from its directory (load_version), not decoded in the pool's process")

    async def served_digests(self, names: Sequence[str], grids: Mapping[str, Grid] | None = None) -> ServedDigests:
        """Each checkpoint tensor of `names` as vLLM serves it, from every rank's slices: a tensor a rank
        holds whole by that rank's digest; one split over ranks by its tiles (`grids`: the version's hash
        grids), None when the ranks' tiles do not cover it; ranks that disagree give a digest nothing matches."""
        self._check_serving()
        async with self._update_lock, self._lock:
            answers = await asyncio.to_thread(self._engine.collective_rpc, "deltamesh_tiles", args=(list(names),))
            return ServedDigests(self._version, {name: _combined(name, answers, (grids or {}).get(name))
                                                 for name in names})

    # -- internals ---------------------------------------------------------------------------------
    def _reports(self, method: str, *args: Any) -> list[RankReport]:
        return [RankReport.from_body(raw) for raw in self._engine.collective_rpc(method, args=args)]

    async def _locked(self, method: str, *args: Any) -> list[RankReport]:
        """Call every rank between two engine steps: vLLM's executor carries one call at a time."""
        async with self._lock:
            return await asyncio.to_thread(self._reports, method, *args)

    async def _prepared(self, method: str, *args: Any) -> list[RankReport]:
        """Begin `method` on every rank, then ask for the outcome every `POLL_S` (generation goes on in
        between) until every rank that began is done."""
        begun = await self._locked(method, *args)
        reports = begun
        while any(r.ok and not r.done for r in reports):
            await asyncio.sleep(POLL_S)
            polled = await self._locked("deltamesh_outcome")
            reports = [p if b.ok else b for b, p in zip(begun, polled)]
        return reports

    async def _swap(self, prepare: tuple, load: tuple, way: str, version: int) -> list[RankReport]:
        async with self._update_lock:
            try:
                prepared = await self._prepared(*prepare)
                agreed(prepared, version, self.model_id)
            except BaseException:  # cancelled too: no rank may stay half way
                async with self._lock:
                    await self._revert()  # host copies only: vLLM was not touched
                self.metrics.update_done(way, False, 0.0)
                raise
            async with self._lock:  # between two engine steps
                paused = time.perf_counter()
                loaded = await asyncio.to_thread(self._reports, *load)
                failed = [r for r in loaded if not r.ok]
                if failed:
                    await self._revert()
                    self.metrics.update_done(way, False, 0.0)
                    state = "weights lost" if self._weights_lost else f"still serving v{self._version}"
                    raise EngineError(f"{self.model_id}: vLLM failed to take v{version} on rank {failed[0].rank} "
                                      f"({failed[0].error}); {state}")
                settled = await asyncio.to_thread(self._reports, "deltamesh_settle")
                if not all(r.ok for r in settled):
                    self._weights_lost = f"a rank could not settle v{version}: {[r.error for r in settled if not r.ok]}"
                else:
                    self._weights_lost = ""
            seconds = time.perf_counter() - paused
        self._reload_s = max(r.load_s for r in loaded)
        self.metrics.update_done(way, True, seconds)
        self._set_version(version)
        log.info("%s: v%d %s on %d ranks (%.3f s paused, %.3f s in vLLM)", self.model_id, version, way,
                 len(loaded), seconds, self._reload_s)
        return [_with_load(p, load.load_s) for p, load in zip(prepared, loaded)]

    async def _revert(self) -> None:
        """Every rank puts its host copy back (and what it loaded into vLLM); the caller holds the lock."""
        reverted = await asyncio.to_thread(self._reports, "deltamesh_revert")
        failed = [r for r in reverted if not r.ok]
        if failed:
            self._weights_lost = f"rank {failed[0].rank} could not put v{self._version} back: {failed[0].error}"
            log.error("%s: %s", self.model_id, self._weights_lost)


def agreed(reports: list[RankReport], version: int | None, model: str) -> None:
    """Raise unless every rank did what was asked and all name one signed weights hash; the first
    refusal is raised as the error class its rank named."""
    refused = [r for r in reports if not r.ok]
    if refused:
        first = refused[0]
        detail = "; ".join(f"rank {r.rank}: {r.error}" for r in refused)
        raise _ERRORS.get(first.kind, EngineError)(f"{model}: {len(refused)} of {len(reports)} ranks refused "
                                                   f"v{version}: {detail}")
    if version is not None and len({(r.version, r.weights_hash) for r in reports}) != 1:
        raise CorruptError(f"{model}: the ranks verified different manifests for v{version}: "
                           f"{[(r.rank, r.version, r.weights_hash) for r in reports]}")


def _with_load(report: RankReport, load_s: float) -> RankReport:
    report.load_s = load_s
    return report


def _combined(name: str, answers: list[dict], grid: Grid | None) -> str | None:
    """One tensor's digest from the ranks' answers (`RankWorker.deltamesh_tiles`)."""
    parts = [answer[name] for answer in answers if name in answer]
    if not parts or any(part is None for part in parts):
        return None
    wholes = {part["whole"] for part in parts if "whole" in part}
    tiles: dict[int, str] = {}
    clash = False
    for part in parts:
        for index, digest in part.get("tiles", {}).items():
            clash |= tiles.setdefault(int(index), digest) != digest
    if len(wholes) > 1 or clash:
        return f"ranks disagree on {name}"
    if wholes:
        return wholes.pop()
    if grid is None or len(tiles) != len(grid.tiles):
        return None
    return combine_digests(tiles[i] for i in range(len(grid.tiles)))

