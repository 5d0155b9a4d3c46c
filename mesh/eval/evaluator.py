"""The evaluator: a policy's published versions scored on a held-out set, beside training, never in its way.

`Evaluator.run` follows a gateway as a rollout pool does (the same weight stream, `PolicyWeights`:
signed manifests, verified pieces, hot swap, and after every swap the check that reads the engine's
weights back against the trainer's signed hashes), but instead of the head it moves to the next
version it is to score (`schedule.py`: version 0, every k-th, any asked for), waits for it to be
published, scores it (`scoring.py`: avg@n through the workflow's own episode) and stores the result
with the version and the weights hash that the check proved the engine served (`store.py`). Only a
proven version is scored: a check that fails drifts the stream (it reloads in full and checks again)
and nothing is stored until one passes. A scoring in which every episode raised (engine or workflow
errors, not wrong answers) is no score: nothing is stored, it counts as failed and is tried again. The engine does not move while a version is scored (the
stream's rounds run one after another, and scoring is one). A requested version older than the one
held is fetched as a full route into a scratch directory, loaded, checked and scored, and the next
round brings the engine back to where the stream is. A due version no longer at any gateway (a
plan the gateway cannot make, while the head is past it) is skipped and counted.

Nothing here talks to the trainer or the broker: the trainer never waits for an evaluation, and the
evaluator's answers are never trained on. It runs on whatever cores it is given; on a machine shared
with the trainer it takes compute from it like any other process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import shutil
import time
from pathlib import Path
from typing import Any

from deltamesh.http import HttpError
from deltamesh.mesh.engines.base import Engine, EngineError
from deltamesh.mesh.eval.config import EvalConfig
from deltamesh.mesh.eval.metrics import EvalMetrics
from deltamesh.mesh.eval.schedule import Schedule
from deltamesh.mesh.eval.scoring import Score, score_tasks
from deltamesh.mesh.eval.store import EvalResult, EvalStore
from deltamesh.mesh.pool.metrics import PoolMetrics
from deltamesh.mesh.pool.serve_check import ServeCheck
from deltamesh.mesh.pool.sync_config import PoolSyncConfig, WeightSyncSettings
from deltamesh.mesh.pool.weight_sync import WeightSync
from deltamesh.mesh.pool.weights import PolicyWeights
from deltamesh.mesh.workflows import EpisodeContext, Task, Workflow
from deltamesh.signals import wait_event

log = logging.getLogger(__name__)

NO_PLAN = 409
"""What a gateway answers for a plan to a version it no longer holds the way to."""


def sync_config(config: EvalConfig, *, endpoint: str = "", dir: str | None = None, name: str | None = None
                ) -> PoolSyncConfig:
    """The weight stream's settings: the evaluator's gateway settings, its name, directory and model."""
    shared = {f.name: getattr(config, f.name) for f in dataclasses.fields(WeightSyncSettings)}
    shared["tier"] = config.tier or "eval"
    return PoolSyncConfig(**shared, name=name or config.name, dir=dir or config.dir, model=config.model_id,
                          engine=config.engine, endpoint=endpoint)


class Evaluator:
    def __init__(self, config: EvalConfig, engine: Engine, workflow: Workflow, ctx: EpisodeContext,
                 tasks: list[Task], heldout: str, store: EvalStore, metrics: EvalMetrics,
                 pool_metrics: PoolMetrics | None = None, *, endpoint: str = "") -> None:
        self.config = config
        self.engine = engine
        self.workflow = workflow
        self.ctx = ctx
        self.tasks = tasks
        self.heldout = heldout
        self.store = store
        self.metrics = metrics
        self.model_id = config.model_id
        self.weights = PolicyWeights(engine, sync_config(config, endpoint=endpoint), metrics=pool_metrics,
                                     check=config.check)
        self.schedule = Schedule(config.every, store.versions(self.model_id, heldout))
        self.skipped: list[int] = []
        self.scoring: int | None = None
        """The version being scored now, if any."""
        self.last_error = ""
        self._requested = asyncio.Event()

    # -- requests --------------------------------------------------------------------------------
    def request(self, version: int) -> bool:
        """Ask for `version` to be scored; False if it already is (or was skipped)."""
        added = self.schedule.request(version)
        if added:
            self._requested.set()
        return added

    def status(self) -> dict[str, Any]:
        w = self.weights
        return {
            "model_id": self.model_id, "heldout": self.heldout, "problems": len(self.tasks),
            "samples": self.config.samples, "every": self.config.every, "engine_version": w.version,
            "head": w.sync.head, "scoring": self.scoring, "requested": sorted(self.schedule.requested),
            "skipped": list(self.skipped), "waiting": self.schedule.waiting(w.sync.head),
            "last_check": w.status.last_check, "drifted": w.status.drifted, "last_error": self.last_error,
        }

    # -- the loop --------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        await self.weights.run(stop, rounds=self._round)

    async def _round(self, wait_s: float) -> bool:
        """Score what the engine holds if it is due, else a past request, else move to the next due
        version (waiting up to `wait_s` for it to be published); True if something was done."""
        # Where the stream is: the directory's version (the engine is brought back to it after a past request).
        held = max((v for v in (self.weights.version, self.weights.writer.held) if v is not None), default=None)
        if (held is not None and held == self.weights.version and self.schedule.due(held)
                and self.weights.proven is not None):
            await self._score_held("request" if held in self.schedule.requested else self._why(held))
            return True
        past = self.schedule.past_request(held)
        if past is not None:
            await self._score_past(past)
            return True
        target = self.schedule.next_after(held)
        self.metrics.waiting.labels(self.model_id).set(self.schedule.waiting(self.weights.sync.head))
        if target is None:
            self._requested.clear()
            await wait_event(self._requested, wait_s)
            return False
        try:
            moved = await self.weights.sync_round(wait_s, to=target)
        except HttpError as e:
            head = self.weights.sync.head
            if e.status != NO_PLAN or head is None or head <= target:
                raise
            self._skip(target, f"no plan to it at the gateway (head v{head}): {e}")
            return True
        if moved and self.weights.version == target and self.weights.proven is not None:
            await self._score_held("request" if target in self.schedule.requested else self._why(target))
        return moved

    def _why(self, version: int) -> str:
        return "initial" if version == 0 else "every"

    def _skip(self, version: int, reason: str) -> None:
        log.warning("%s: skipping v%d: %s", self.model_id, version, reason)
        self.schedule.finished(version)
        self.skipped.append(version)
        self.metrics.runs.labels(self.model_id, "skipped").inc()

    async def _score_held(self, reason: str) -> None:
        """Score the version the engine serves, proven by the stream's last check."""
        manifest = self.weights.proven
        assert manifest is not None
        check = self.weights.status.last_check
        await self._score(manifest.version, manifest.weights_hash, check, reason)

    async def _score(self, version: int, weights_hash: str, check: str, reason: str) -> None:
        self.scoring = version
        log.info("%s: scoring v%d (%s) on %d held-out problems x %d samples", self.model_id, version, reason,
                 len(self.tasks), self.config.samples)
        try:
            score = await score_tasks(self.workflow, self.ctx, self.tasks)
        except (EngineError, OSError) as e:
            self.last_error = f"scoring v{version} failed: {e}"
            self.metrics.runs.labels(self.model_id, "failed").inc()
            raise EngineError(self.last_error) from e
        finally:
            self.scoring = None
        if score.problems and score.failed == score.problems:
            # Not a measurement of the model: every episode broke (engine or workflow errors), so its
            # "0 correct" would read as a real score of 0. Nothing is stored; the stream's next round
            # (after the failure backoff) scores the version again.
            self.last_error = (f"scoring v{version} failed: every one of {score.problems} held-out episodes raised; "
                               f"no score stored")
            self.metrics.runs.labels(self.model_id, "failed").inc()
            log.error("%s: %s", self.model_id, self.last_error)
            raise EngineError(self.last_error)
        if self.engine.version != version:  # nothing swaps during a round; a guard against that ever changing
            self.last_error = f"the engine moved from v{version} to v{self.engine.version} while scoring"
            self.metrics.runs.labels(self.model_id, "failed").inc()
            raise EngineError(self.last_error)
        self._store(version, weights_hash, check, reason, score)

    def _store(self, version: int, weights_hash: str, check: str, reason: str, score: Score) -> None:
        result = EvalResult(model_id=self.model_id, version=version, weights_hash=weights_hash, heldout=self.heldout,
                            accuracy=score.accuracy, samples=self.config.samples, problems=score.problems,
                            correct=score.correct, failed=score.failed, by_level=score.by_level,
                            seconds=score.seconds, scored_at=time.time(), check=check, reason=reason)
        self.store.add(result)
        self.schedule.finished(version)
        self.last_error = ""
        self.metrics.runs.labels(self.model_id, "scored").inc()
        self.metrics.seconds.labels(self.model_id).observe(score.seconds)
        newest = max(self.store.versions(self.model_id, self.heldout))
        if version == newest:
            self.metrics.version.labels(self.model_id).set(version)
            self.metrics.accuracy.labels(self.model_id).set(score.accuracy)
        log.info("%s: v%d avg@%d %.3f (%d/%d correct, %.1f s, weights %s)", self.model_id, version,
                 self.config.samples, score.accuracy, score.correct, score.samples, score.seconds, weights_hash[:16])

    async def _score_past(self, version: int) -> None:
        """Score an older version: its full route into a scratch directory, loaded and checked, then
        scored; the stream's next round reloads the engine from its own directory."""
        scratch = Path(self.config.dir).with_name(Path(self.config.dir).name + ".past")
        await asyncio.to_thread(shutil.rmtree, scratch, True)
        try:
            cfg = sync_config(self.config, dir=str(scratch), name=f"{self.config.name}.past")
            async with WeightSync(cfg) as sync:
                try:
                    plan = await sync.fetch_plan(version, full=True)
                except HttpError as e:
                    if e.status != NO_PLAN:
                        raise
                    self._skip(version, f"no full route to it at the gateway: {e}")
                    return
                manifest = await sync.persist(await sync.fetch_decoded(plan))
            await self.engine.load_version(scratch, version)
            result = await ServeCheck(self.config.check).run(self.engine, manifest, None)
            if not result.ok:
                self.last_error = f"v{version} loaded for a request does not check: {result.reason}"
                self.metrics.runs.labels(self.model_id, "failed").inc()
                raise EngineError(self.last_error)
            await self._score(version, manifest.weights_hash, result.describe(), "request")
        finally:
            await asyncio.to_thread(shutil.rmtree, scratch, True)
