"""The deltamesh side of every vLLM worker: a rank's share of the weights, taken version by version.

vLLM mixes `RankWorker` into each of its workers (`worker_extension_cls`), and the driver calls its
methods by name through `collective_rpc` (vllm_ranks.py), with plain JSON-able arguments and answers:
no Python function or tensor is pickled to reach a worker. Each worker keeps a `RankShare`
(vllm_rank_share.py) for its tensor-parallel rank. `deltamesh_open` reads the share of the model
directory vLLM loaded. `deltamesh_prepare` begins to fetch, verify and apply a version to the host
copy on a thread of its own, so the worker goes on running the engine's steps meanwhile, and
`deltamesh_outcome` tells when it is done; `deltamesh_load` then hands the layers the version changed
to vLLM's in-place reload (the model's own `load_weights` and post-processing, as `vllm_weights.py`
does for a whole model: full-shaped checkpoint tensors that vLLM's loaders narrow to this rank's
share), and `deltamesh_settle` or `deltamesh_revert` end it. `deltamesh_stage` and
`deltamesh_reload_dir` do the same for a model directory read from disk. `deltamesh_tiles` shows
what vLLM serves on this rank: its slice of each checkpoint tensor (de-fused,
without vocabulary padding) by the tiles of the version's hash grids; `deltamesh_parameters` and
`deltamesh_digests` read vLLM's parameters as they are (what checks the layout rules against vLLM).

The module's functions (`reload_share`, `reload_previous`, `served_shares`) do the same for any
holder of a worker's model and its reload, the weight-transfer backend's tensor-parallel path too.

Every method answers with a report and never raises: vLLM's `collective_rpc` stops reading the other
workers' answers at the first worker that raises, which would leave them to a later call.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

import torch

from deltamesh.delta.layouts import PoolLayout
from deltamesh.mesh.engines.vllm_rank_share import RankReport, RankShare, RankStep
from deltamesh.mesh.engines.vllm_weights import Fusion, finish_reload, param_rows, quiet_partial_reload

log = logging.getLogger(__name__)

QUALNAME = "deltamesh.mesh.engines.vllm_rank_worker.RankWorker"
"""What vLLM's `worker_extension_cls` names."""


class RankWorker:
    """Mixed into vLLM's worker class (see the module docstring); `self` is the worker."""

    _deltamesh_share: RankShare | None = None

    def deltamesh_open(self, model_dir: str, layout: Mapping[str, Any]) -> dict:
        """Read this rank's share of `model_dir` (what vLLM loaded at start) for pool layout `layout`."""
        return self._deltamesh_call(lambda rank: self._deltamesh_read(model_dir, layout, rank))

    def deltamesh_prepare(self, step: Mapping[str, Any]) -> dict:
        """Begin to fetch, verify and apply a plan step (`RankStep.body`) to this rank's host copy, beside
        the engine's steps; `deltamesh_outcome` tells when it is done."""
        request = RankStep.from_body(step)
        return self._deltamesh_call(lambda rank: self._deltamesh_begin(rank, lambda share: share.prepare(request)))

    def deltamesh_stage(self, directory: str, version: int) -> dict:
        """Begin to read this rank's share of model directory `directory` (holding `version`) beside the
        host copy; `deltamesh_outcome` tells when it is done."""
        return self._deltamesh_call(lambda rank: self._deltamesh_begin(rank, lambda share: share.stage(directory, version)))

    def deltamesh_outcome(self) -> dict:
        """The report of what `deltamesh_prepare` or `deltamesh_stage` began (`done` False while it runs)."""
        def outcome(rank: int) -> RankReport:
            report = self._deltamesh_held().outcome()
            return RankReport(rank, done=False) if report is None else report
        return self._deltamesh_call(outcome)

    def deltamesh_load(self) -> dict:
        """Hand vLLM every layer the prepared version changed on this rank."""
        def load(rank: int) -> RankReport:
            share = self._deltamesh_held()
            share.loading()
            return RankReport(rank, load_s=reload_share(self.model_runner.get_model(), self.reload_weights, share,
                                                        share.changed()))
        return self._deltamesh_call(load)

    def deltamesh_reload_dir(self, directory: str) -> dict:
        """vLLM reads the checkpoint in `directory` itself and reprocesses every layer."""
        def reload(rank: int) -> RankReport:
            started = time.perf_counter()
            self._deltamesh_held().loading()
            self.reload_weights(weights_path=directory, is_checkpoint_format=True)
            return RankReport(rank, load_s=time.perf_counter() - started)
        return self._deltamesh_call(reload)

    def deltamesh_settle(self) -> dict:
        def settle(rank: int) -> RankReport:
            share = self._deltamesh_held()
            share.settle()
            return RankReport(rank, version=-1 if share.version is None else share.version)
        return self._deltamesh_call(settle)

    def deltamesh_revert(self) -> dict:
        """Put the host copy back and, where vLLM was handed the version, those layers as they were."""
        def revert(rank: int) -> RankReport:
            share = self._deltamesh_held()
            names = share.revert()
            if not names:
                return RankReport(rank)
            return RankReport(rank, load_s=reload_previous(self.model_runner.get_model(), self.model_runner.model_config,
                                                           self.reload_weights, share, names))
        return self._deltamesh_call(revert)

    def deltamesh_tiles(self, names: list[str]) -> dict:
        """What vLLM serves of each of `names` this rank holds, as `RankShare.proofs` shows it (None for
        each when it cannot be read)."""
        share = self._deltamesh_share
        if share is None:
            return {}
        try:
            return share.proofs(served_shares(self.model_runner.get_model(), share), names)
        except Exception as e:  # noqa: BLE001 - unreadable, never a worker that raises
            log.warning("rank tiles: %s: %s", type(e).__name__, e)
            return {name: None for name in names if name in share.shares}

    def deltamesh_parameters(self) -> dict:
        """vLLM's parameters on this rank: name -> [shape, dtype]."""
        model = self.model_runner.get_model()
        return {name: [list(p.shape), str(p.dtype).removeprefix("torch.")] for name, p in model.named_parameters()}

    def deltamesh_digests(self, regions: Mapping[str, list]) -> dict:
        """xxh3-128 of rows [start, stop) of vLLM parameters: label -> [parameter, start, stop]."""
        from deltamesh.delta import tensor_digest

        params = dict(self.model_runner.get_model().named_parameters())
        return {label: tensor_digest(params[name].data[start:stop].contiguous()) if name in params else None
                for label, (name, start, stop) in regions.items()}

    # -- internals ---------------------------------------------------------------------------------
    def _deltamesh_call(self, run: Callable[[int], Any]) -> dict:
        from vllm.distributed import get_tensor_model_parallel_rank

        rank = get_tensor_model_parallel_rank()
        try:
            out = run(rank)
        except Exception as e:  # noqa: BLE001 - reported to the driver, which decides for every rank
            log.warning("rank %d: %s: %s", rank, type(e).__name__, e)
            return RankReport.failed(rank, e).body()
        return out.body() if isinstance(out, RankReport) else out

    def _deltamesh_read(self, model_dir: str, layout: Mapping[str, Any], rank: int) -> RankReport:
        share = RankShare.read(model_dir, PoolLayout(**layout), rank)
        self._deltamesh_share = share
        return RankReport(rank, version=-1 if share.version is None else share.version)

    def _deltamesh_begin(self, rank: int, work: Callable[[RankShare], RankReport]) -> RankReport:
        share = self._deltamesh_held()
        share.begin(lambda: work(share))
        return RankReport(rank, done=False)

    def _deltamesh_held(self) -> RankShare:
        if self._deltamesh_share is None:
            raise RuntimeError("deltamesh_open was not called on this worker")
        return self._deltamesh_share


# -- a rank's share in vLLM, for this extension and the weight-transfer backend alike ------------------
Reload = Callable[..., None]
"""vLLM's in-place reload of one worker (`weights_iterator=`, `is_checkpoint_format=`): the worker's
`reload_weights`, or vLLM's function bound to the worker's model."""


def reload_share(model: torch.nn.Module, reload: Reload, share: RankShare, changed: list[str]) -> float:
    """Hand vLLM every checkpoint tensor of each layer one of `changed` feeds (a layer handed part of
    its inputs would be rebuilt with the rest uninitialised), from `share`; seconds spent in vLLM."""
    if not changed:
        return 0.0
    fusion = _fusion(model)
    names = fusion.layer_groups(changed, fusion.group(share.table))
    started = time.perf_counter()
    with quiet_partial_reload(len(names) < len(share.table)):
        reload(weights_iterator=share.loads(names), is_checkpoint_format=True)
    return time.perf_counter() - started


def reload_previous(model: torch.nn.Module, model_config: Any, reload: Reload, share: RankShare,
                    names: list[str]) -> float:
    """After `share.revert()` named `names`: vLLM takes their previous values again; seconds in vLLM."""
    # a reload that raised half way leaves layers on the meta device
    finish_reload(model, model_config)
    return reload_share(model, reload, share, names)


def served_shares(model: torch.nn.Module, share: RankShare) -> dict[str, torch.Tensor | None]:
    """What vLLM holds of each of this rank's shares, found in its (fused) parameters (None: not found
    as it is, e.g. a layer the CPU build repacked)."""
    params = dict(model.named_parameters())
    fusion = _fusion(model)
    local = {name: s.local_shape(share.table[name].shape) for name, s in share.shares.items()}
    served: dict[str, torch.Tensor | None] = {}
    for name, shape in local.items():
        place = fusion.place(name, local)
        served[name] = None if place is None else param_rows(params, place[0], place[1], tuple(shape),
                                                             share.slices[name].dtype)
    return served


def _fusion(model: torch.nn.Module) -> Fusion:
    return Fusion(dict(getattr(model, "packed_modules_mapping", {}) or {}))
