"""The backend's tensor-parallel path: each vLLM worker fetches, verifies and applies only its rank's share.

With `tensor_parallel_size` > 1 vLLM creates the backend on every worker and its RL API calls all of
them at once. Each worker then keeps `RankUpdates`: a host copy of its own share of the checkpoint
(`deltamesh.mesh.engines.vllm_rank_share.RankShare`, the share path of `VLLMRanksEngine`, read from
the directory vLLM loaded), never the whole model. One update step goes as in `VLLMRanksEngine`, the
ranks agreeing at each phase over vLLM's own tensor-parallel CPU group (`RankGroup`: all-gathers of
JSON bytes, never a pickled object):

1. the lead rank (0) asks its gateway for the transfer plan and every rank takes the same steps;
2. each rank fetches only the pieces that reach its share (`fetch_share`, its own fetcher, peer
   `pool/NAME/rankN`), verifies them against the trainer-signed manifest and applies them to its host
   share, checked against the manifest's tiles (`RankShare.prepare`);
3. only when every rank did, and all name the same signed weights hash, does each rank hand vLLM's
   in-place reload the layers it changed (`reload_share`); then each reads its slices of vLLM's
   parameters back and checks them against the manifest's tiles.

A refusal on any rank (a piece that does not verify, a wrong base, no gateway serving it) makes every
rank put its host share back before vLLM is touched; a reload or read-back that fails on any rank makes
every rank load its previous values again. Either way every rank raises the same refusal, naming each
rank's reason, and the server serves what it served. What each rank fetched and proved is returned, so
the lead's status (`/v1/status` at `metrics_listen`) shows it rank by rank.
"""

from __future__ import annotations

import json
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable, TypeVar

import torch
import torch.distributed as dist

from deltamesh.delta import CodecError, Manifest
from deltamesh.delta.layouts import PoolLayout
from deltamesh.delta.shares import check_share
from deltamesh.gateway.plan import PlanStep
from deltamesh.mesh.engines.vllm_rank_share import RankReport, RankShare, RankStep
from deltamesh.mesh.engines.vllm_rank_worker import reload_previous, reload_share, served_shares
from deltamesh.mesh.engines.vllm_ranks import agreed
from deltamesh.mesh.pool.sync_config import WeightSyncSettings

T = TypeVar("T")


class RankGroup:
    """The tensor-parallel ranks of one server, agreeing by all-gathers of JSON over a CPU process group."""

    def __init__(self, group: Any, rank: int, size: int) -> None:
        self.group, self.rank, self.size = group, rank, size

    @classmethod
    def of_vllm(cls) -> "RankGroup":
        """vLLM's tensor-parallel group of this worker (its gloo CPU group)."""
        from vllm.distributed import get_tp_group

        tp = get_tp_group()
        return cls(tp.cpu_group, tp.rank_in_group, tp.world_size)

    def gather(self, value: Any) -> list[Any]:
        """Every rank's `value` (JSON-able), in rank order; every rank must call it."""
        data = json.dumps(value).encode()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(self.size)]
        dist.all_gather(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.group)
        longest = max(int(s) for s in sizes)
        mine = torch.zeros(longest, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = [torch.empty(longest, dtype=torch.uint8) for _ in range(self.size)]
        dist.all_gather(out, mine, group=self.group)
        return [json.loads(bytes(t[:int(n)].tolist())) for t, n in zip(out, sizes)]


class RanksRefused(RuntimeError):
    """A step some rank refused or could not take; every rank still serves what it served."""


class WeightsLost(RuntimeError):
    """A rank could not load its previous values again after a failed step: the server must be restarted."""


class RankUpdates:
    """This worker's share of the model, taken step by step in agreement with the other ranks (see the
    module docstring)."""

    def __init__(self, model: torch.nn.Module, vllm_config: Any, model_dir: str | Path, layout: PoolLayout,
                 group: RankGroup) -> None:
        from vllm.model_executor.model_loader.reload.inplace import reload_weights

        self.model, self.model_config = model, vllm_config.model_config
        self.group = group
        self._reload = partial(reload_weights, vllm_config, model, weights_path=None)
        read: list[RankShare] = []

        def open_share() -> RankReport:
            read.append(RankShare.read(model_dir, layout, group.rank))
            return RankReport(group.rank, version=-1 if read[0].version is None else read[0].version)

        # A rank that cannot read its share fails the init on every rank, so that none waits alone later.
        agreed(self._each(open_share), None, f"{model_dir} ({layout.name})")
        self.share = read[0]

    @property
    def version(self) -> int | None:
        return self.share.version

    @property
    def weights_hash(self) -> str | None:
        return None if self.share.held is None else self.share.held.weights_hash

    def plan(self, lead: Callable[[], list[PlanStep]]) -> list[PlanStep]:
        """The steps the lead rank's `lead()` names, on every rank; the lead's error raised on every rank."""
        error: BaseException | None = None
        answer: dict[str, Any] = {}
        if self.group.rank == 0:
            try:
                answer = {"steps": [step.to_json() for step in lead()]}
            except Exception as e:  # noqa: BLE001 - raised below, once every rank knows
                error, answer = e, {"error": f"{type(e).__name__}: {e}"}
        said = self.group.gather(answer)[0]
        if error is not None:
            raise error
        if "error" in said:
            raise RanksRefused(f"the lead rank could not plan: {said['error']}")
        return [PlanStep.from_json(raw) for raw in said["steps"]]

    def take(self, step: PlanStep, model_id: str, sync: WeightSyncSettings, peer: str,
             check: bool) -> tuple[Manifest, list[dict[str, Any]]]:
        """Move vLLM to `step` on every rank (see the module docstring); the verified manifest and each
        rank's account (its `RankReport` with `checked`/`unreadable` tensors). RanksRefused when any rank
        refused, with every rank serving what it served."""
        share = self.share
        request = RankStep(model_id, step, sync, peer)
        prepared = self._each(lambda: _off_thread(partial(share.prepare, request)))
        try:
            agreed(prepared, step.version, model_id)  # raises the first refusing rank's error class
        except Exception:
            share.revert()  # host shares only: vLLM was not touched
            raise
        manifest = share.prepared
        assert manifest is not None  # every rank prepared the step
        share.loading()
        loaded = self._each(lambda: RankReport(self.group.rank, load_s=reload_share(
            self.model, self._reload, share, share.changed())))
        checks = self.group.gather(self._check(manifest, share.changed()) if check
                                   else {"checked": 0, "unreadable": 0, "check_s": 0.0})
        refused = [f"rank {r.rank}: {r.error}" for r in loaded if not r.ok]
        refused += [f"rank {rank}: {c['error']}" for rank, c in enumerate(checks) if "error" in c]
        if refused:
            self._put_back(share, f"v{step.version}")
            raise RanksRefused(f"{model_id}: v{step.version} not taken by vLLM: {'; '.join(refused)}")
        share.settle()
        return manifest, [{**p.body(), "load_s": load.load_s, **c} for p, load, c in zip(prepared, loaded, checks)]

    # -- internals ---------------------------------------------------------------------------------
    def _each(self, work: Callable[[], RankReport]) -> list[RankReport]:
        """`work()` on this rank, then every rank's report; a rank whose work raised reports its error,
        so that every rank always reaches the gather."""
        try:
            report = work()
        except Exception as e:  # noqa: BLE001 - every rank decides on every rank's outcome
            report = RankReport.failed(self.group.rank, e)
        return [RankReport.from_body(raw) for raw in self.group.gather(report.body())]

    def _check(self, manifest: Manifest, changed: list[str]) -> dict[str, Any]:
        """This rank's slices of vLLM's parameters that the step changed, against the manifest's tiles:
        how many matched (`checked`), could not be read as they are (`unreadable`), and an `error` naming
        the first that differs or why none could be read."""
        started = time.perf_counter()
        try:
            out = self._compare(manifest, changed)
        except Exception as e:  # noqa: BLE001 - every rank must reach the gather that follows
            out = {"checked": 0, "unreadable": 0, "error": f"reading vLLM's parameters back failed: "
                                                           f"{type(e).__name__}: {e}"}
        return {**out, "check_s": time.perf_counter() - started}

    def _compare(self, manifest: Manifest, changed: list[str]) -> dict[str, Any]:
        share = self.share
        entries = {t.name: t for t in manifest.tensors}
        served = served_shares(self.model, share)
        checked = unreadable = 0
        wrong = []
        for name in changed:
            t = served.get(name)
            if t is None:
                unreadable += 1  # e.g. a layer vLLM's CPU build repacked: not comparable as it is
                continue
            try:
                ok = check_share(entries[name], share.shares[name], t.contiguous())
            except CodecError:
                unreadable += 1
                continue
            checked += 1
            if not ok:
                wrong.append(name)
        out: dict[str, Any] = {"checked": checked, "unreadable": unreadable}
        if wrong:
            out["error"] = f"vLLM does not serve what was applied: {len(wrong)} tensors differ, e.g. {wrong[0]!r}"
        return out

    def _put_back(self, share: RankShare, what: str) -> None:
        names = share.revert()
        if names:
            try:
                reload_previous(self.model, self.model_config, self._reload, share, names)
            except Exception as e:
                raise WeightsLost(f"deltamesh: {what} failed and rank {self.group.rank}'s previous weights could "
                                   f"not be restored; reload the server ({type(e).__name__}: {e})") from e


def _off_thread(work: Callable[[], T]) -> T:
    """`work()` on a thread of its own: `RankShare.prepare` runs an event loop of its own, which a
    thread that runs one already could not."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as e:  # noqa: BLE001 - raised in the caller
            result["error"] = e

    thread = threading.Thread(target=run, name="deltamesh-rank-fetch", daemon=True)
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]
