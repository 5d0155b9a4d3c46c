"""The `deltamesh` weight-transfer backend on vLLM's workers: versions from the mesh, verified, in place.

vLLM creates one `DeltameshWeightTransferEngine` per worker when the server runs with
`--weight-transfer-config '{"backend": "deltamesh"}'`, and calls it from its RL API:

- `init_transfer_engine` (`POST /init_weight_transfer_engine`): reads `init_info` (`config.py`), reads
  the directory vLLM loaded into a host copy of the checkpoint tensors (checked against its manifest
  when it holds a deltamesh version, which it then serves), and opens the way to the mesh
  (`receiver.py`) on the backend's own event loop thread.
- `update_weights` (`POST /update_weights`, `{"update_info": {"version": N}}`, or no version for the
  head): fetches the steps from the version served to N through the gateways, each verified (the
  trainer's signature, every piece's hash), decodes them, applies each to the host copy with the
  codec's applier, which checks every resulting tensor against its signed hash and undoes its writes
  when one is wrong (`deltamesh.mesh.engines.host_weights`), and only then hands vLLM the layers whose
  tensors changed, through its in-place reload (`worker_weights.py`). Then vLLM's own parameters are
  read back and compared with the signed hashes (the pool's serve check: `deltamesh.mesh.pool.serve_check`).
  Anything refused before the reload (a bad signature, a corrupt piece, a wrong base, a rollback)
  leaves vLLM's weights untouched; a reload that fails, or whose read-back differs, is undone by
  reloading the previous tensors of the same layers. Either way the call raises, so vLLM's route
  answers an error, and the server goes on serving what it served.
- `start_weight_update` / `finish_weight_update`: nothing to prepare or finalize (each update is whole
  inside `update_weights`); the weight version vLLM reports at `/weight_info` is what the caller of
  `/finish_weight_update` names (the deltamesh trainer engine and the follow mode name the version).

With tensor parallelism (`tensor_parallel_size` > 1) no worker keeps the whole host copy: each rank
keeps its own share and takes each step of the lead rank's plan in agreement with the others
(`rank_updates.py`, the share path of `VLLMRanksEngine`), and the proof names what each rank fetched
and checked.

vLLM runs these calls between engine steps, so no forward pass sees half an update.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

import torch
from vllm.distributed.weight_transfer.base import WeightTransferEngine

from deltamesh.delta import DecodedVersion, dir_manifest, read_weights
from deltamesh.logs import setup_guest_logging
from deltamesh.loop_thread import LoopThread
from deltamesh.mesh.engines.base import EngineError, ServedDigests
from deltamesh.mesh.engines.host_weights import HostWeights
from deltamesh.mesh.engines.local import read_verified
from deltamesh.mesh.engines.vllm_ranks import vllm_layout
from deltamesh.mesh.pool.serve_check import CheckResult, ServeCheck
from deltamesh.mesh.vllm_plugin.config import (
    BackendConfig,
    UpdateInfo,
    config_from_env,
    parse_backend_config,
    parse_update_info,
)
from deltamesh.mesh.vllm_plugin.rank_updates import RankGroup, RanksRefused, RankUpdates, WeightsLost
from deltamesh.mesh.vllm_plugin.receiver import VersionReceiver
from deltamesh.mesh.vllm_plugin.worker_weights import WorkerWeights

log = logging.getLogger(__name__)


class DeltameshWeightTransferEngine(WeightTransferEngine[BackendConfig, UpdateInfo]):
    """The worker side of the `deltamesh` backend (see the module docstring)."""

    init_info_cls = BackendConfig
    update_info_cls = UpdateInfo
    supports_draft_weight_update = False

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        setup_guest_logging()
        self._loop: LoopThread | None = None
        self._receiver: VersionReceiver | None = None
        self._host: HostWeights | None = None
        self._weights: WorkerWeights | None = None
        self._ranks: RankUpdates | None = None
        """With tensor parallelism, this rank's share in place of the whole host copy."""
        self._check = ServeCheck()
        self._held: tuple[str, int | None] | None = None
        """(model id, version) served when the backend was last shut down: a new init goes on from there."""
        from_env = config_from_env()
        if from_env is not None:  # a server that follows a gateway by itself needs no init call
            self.init_transfer_engine(from_env)

    def parse_init_info(self, init_dict: dict[str, Any]) -> BackendConfig:
        return parse_backend_config(init_dict)

    def parse_update_info(self, update_dict: dict[str, Any]) -> UpdateInfo:
        return parse_update_info(update_dict)

    @property
    def version(self) -> int | None:
        return self._receiver.version if self._receiver is not None else None

    def init_transfer_engine(self, init_info: BackendConfig) -> None:
        if self._receiver is not None:
            raise RuntimeError("the deltamesh backend is initialised already (shut it down first)")
        model_dir = Path(self.model_config.model)
        if not model_dir.is_dir():
            raise ValueError(f"the deltamesh backend needs vLLM started from a local model directory, "
                             f"not {self.model_config.model!r}")
        if self._held is not None and self._held[0] != init_info.model:
            raise ValueError(f"this server serves {self._held[0]!r} v{self._held[1]}; another model id needs a "
                             f"server restarted from its directory")
        ranked = self.parallel_config.tensor_parallel_size > 1
        if ranked and self._ranks is None:  # the first init: each rank's host share is what vLLM loaded
            self._ranks = self._open_ranks(model_dir)
        elif not ranked and self._host is None:  # the first init: the host copy is what vLLM loaded
            held = dir_manifest(model_dir)
            if held is not None and held.model_id == init_info.model:
                weights, manifest = read_verified(model_dir, held.version)
                self._host = HostWeights(weights, manifest.weights_hash if manifest is not None else None)
            else:  # weights of no published version: the first update is a full snapshot
                self._host = HostWeights(read_weights(model_dir), None)
            self._weights = WorkerWeights(self.model, self.vllm_config, self._host.weights)
        loop = LoopThread(f"deltamesh-vllm-{init_info.model}")
        receiver = VersionReceiver(init_info, str(model_dir), lead=self.parallel_config.rank == 0,
                                   decodes=self._ranks is None)
        weights_hash = self._ranks.weights_hash if self._ranks is not None else self._host.weights_hash
        failure: BaseException | None = None
        try:
            # Initialised again after a shutdown, the server still serves what it took meanwhile.
            loop.call(receiver.open(self._held[1] if self._held is not None else None, weights_hash))
        except BaseException as e:
            failure = e
        if self._ranks is not None:
            # Only the lead registers: a refusal there fails the init on every rank, so all stay in step.
            said = self._ranks.group.gather("" if failure is None else f"{type(failure).__name__}: {failure}")
            if failure is None and any(said):
                failure = RuntimeError(f"deltamesh: init refused on another rank: {[e for e in said if e][0]}")
            if failure is None and receiver.version != self._ranks.version:
                # A share its directory's manifest cannot vouch for (published without this layout's tiles).
                receiver.sync.version = self._ranks.version
        if failure is not None:
            loop.call(receiver.close())
            loop.close()
            raise failure
        self._loop, self._receiver = loop, receiver
        log.info("deltamesh backend: %s from %s, serving %s", init_info.model, ", ".join(init_info.gateway),
                 f"v{receiver.version}" if receiver.version is not None else "weights of no published version")

    def start_weight_update(self) -> None:
        self._ready()

    def finish_weight_update(self) -> None:
        self._ready()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # Not the base class's: it synchronises an accelerator, and every write here is done on return.
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: UpdateInfo) -> None:
        loop, receiver = self._ready()
        if self._ranks is not None:
            self._receive_shares(update_info)
            return
        try:
            versions = loop.call(receiver.fetch(update_info.version))
        except Exception as e:
            receiver.failed("fetch", f"{type(e).__name__}: {e}")
            raise RuntimeError(f"deltamesh: v{update_info.version if update_info.version is not None else ' head'} "
                               f"refused, still serving {_named(receiver.version)}: {type(e).__name__}: {e}") from e
        for version in versions:
            self._apply(version)

    def shutdown(self) -> None:
        loop, self._loop = self._loop, None
        receiver, self._receiver = self._receiver, None
        if loop is None or receiver is None:
            return
        self._held = (receiver.config.model, receiver.version)
        try:
            loop.call(receiver.close())
        finally:
            loop.close()

    # -- one version into vLLM -----------------------------------------------------------------------
    def _apply(self, version: DecodedVersion) -> None:
        """Host copy, then the layers it changed into vLLM, then the read-back; undone on any failure."""
        loop, receiver = self._ready()
        host, weights = self._host, self._weights
        manifest = version.manifest
        served = receiver.version
        started = time.perf_counter()
        try:
            result, changed = host.apply(version, served if served is not None else -1)
        except Exception as e:
            receiver.failed(manifest.kind, f"v{manifest.version}: {e}")
            raise RuntimeError(f"deltamesh: v{manifest.version} refused, still serving {_named(served)}: "
                               f"{type(e).__name__}: {e}") from e
        names = weights.layer_groups(changed)
        before = {**host.weights, **host.previous()}  # what vLLM holds until it takes the update
        check: CheckResult | None = None
        try:
            weights.load(result, names)
            if receiver.config.check:
                check = loop.call(self._check.run(_ReadBack(weights, manifest.version, result), manifest, changed))
                if not check.ok:
                    raise EngineError(f"vLLM does not serve what was applied: {check.reason}")
        except Exception as e:
            host.undo(version)
            try:
                weights.restore(before, names)
            except Exception:
                log.exception("deltamesh backend: putting v%s back after a failed update failed", served)
                receiver.failed(manifest.kind, f"v{manifest.version}: {e}; restoring failed", check)
                raise RuntimeError(f"deltamesh: v{manifest.version} failed and the previous weights could not be "
                                   f"restored; reload the server ({type(e).__name__}: {e})") from e
            receiver.failed(manifest.kind, f"v{manifest.version}: {e}", check)
            raise RuntimeError(f"deltamesh: v{manifest.version} not taken, still serving {_named(served)}: "
                               f"{type(e).__name__}: {e}") from e
        host.commit(result, manifest.weights_hash, adopted=manifest.kind == "full")
        seconds = time.perf_counter() - started
        receiver.served(manifest, seconds, check)
        log.info("deltamesh backend: %s now serves %s v%d (%d of %d tensors reloaded, %.3f s; %s)", manifest.model_id,
                 manifest.kind, manifest.version, len(names), len(result), seconds,
                 check.describe() if check is not None else "not checked")

    # -- tensor parallelism: each rank its own share (rank_updates.py) -----------------------------------
    def _open_ranks(self, model_dir: Path) -> RankUpdates:
        parallel = self.parallel_config
        if parallel.pipeline_parallel_size > 1:
            raise ValueError("the deltamesh backend takes tensor- and expert-parallel shares; pipeline parallelism "
                             "is not supported")
        layout = vllm_layout(parallel.tensor_parallel_size, parallel.enable_expert_parallel,
                             self.model_config.get_total_num_kv_heads())
        return RankUpdates(self.model, self.vllm_config, model_dir, layout, RankGroup.of_vllm())

    def _receive_shares(self, update_info: UpdateInfo) -> None:
        """The lead rank plans, then every rank takes each step's share with the others."""
        loop, receiver = self._ready()
        ranks = self._ranks
        assert ranks is not None
        asked = f"v{update_info.version}" if update_info.version is not None else "the head"
        try:
            steps = ranks.plan(lambda: loop.call(receiver.plan(update_info.version)))
        except Exception as e:
            receiver.failed("fetch", f"{type(e).__name__}: {e}")
            raise RuntimeError(f"deltamesh: {asked} refused, still serving {_named(receiver.version)}: "
                               f"{type(e).__name__}: {e}") from e
        config = receiver.config
        peer = f"pool/{config.name or 'vllm'}"
        for step in steps:
            served, started = receiver.version, time.perf_counter()
            try:
                manifest, accounts = ranks.take(step, config.model, receiver.sync.config, peer, config.check)
            except WeightsLost:
                receiver.failed(step.kind, f"v{step.version}: weights lost")
                raise
            except RanksRefused as e:
                receiver.failed(step.kind, f"v{step.version}: {e}")
                raise RuntimeError(f"deltamesh: v{step.version} not taken, still serving {_named(served)}: {e}") from e
            except Exception as e:
                receiver.failed(step.kind, f"v{step.version}: {type(e).__name__}: {e}")
                raise RuntimeError(f"deltamesh: v{step.version} refused, still serving {_named(served)}: "
                                   f"{type(e).__name__}: {e}") from e
            seconds = time.perf_counter() - started
            check = CheckResult(True, manifest.version, checked=sum(a["checked"] for a in accounts),
                                unreadable=sum(a["unreadable"] for a in accounts),
                                seconds=max(a["check_s"] for a in accounts)) if config.check else None
            receiver.served(manifest, seconds, check, ranks=[_account(a) for a in accounts])
            log.info("deltamesh backend: %s now serves %s v%d on rank %d (%d of %d piece bytes fetched, %.3f s; %s)",
                     manifest.model_id, manifest.kind, manifest.version, ranks.group.rank,
                     accounts[ranks.group.rank]["fetched_bytes"], manifest.payload_bytes, seconds,
                     check.describe() if check is not None else "not checked")

    def _ready(self) -> tuple[LoopThread, VersionReceiver]:
        if self._loop is None or self._receiver is None:
            raise RuntimeError("the deltamesh backend is not initialised: POST /init_weight_transfer_engine first")
        return self._loop, self._receiver


class _ReadBack:
    """vLLM's parameters as the pool's serve check reads an engine (`ReadsBack`); the worker thread is
    blocked in the update meanwhile, so no engine step runs while they are read."""

    def __init__(self, weights: WorkerWeights, version: int, checkpoint: dict[str, torch.Tensor]) -> None:
        self._weights, self._version, self._checkpoint = weights, version, checkpoint

    async def served_digests(self, names: Sequence[str], grids: Mapping[str, Any] | None = None) -> ServedDigests:
        # `grids`: the tile grids of tensors hashed by tiles (versions built in parts), when the check has any.
        if grids:
            return ServedDigests(self._version, self._weights.digests(list(names), self._checkpoint, grids))
        return ServedDigests(self._version, self._weights.digests(list(names), self._checkpoint))


def _account(raw: Mapping[str, Any]) -> dict[str, Any]:
    """What the proof shows of one rank's step."""
    return {k: raw[k] for k in ("rank", "fetched_bytes", "payload_bytes", "pieces", "changed", "checked",
                                "unreadable", "fetch_s", "apply_s", "load_s", "check_s")}


def _named(version: int | None) -> str:
    return f"v{version}" if version is not None else "the weights it started with"
