"""A rollout pool process: engines, their weight-sync loops and the rollout worker, wired together.

`RolloutPool(config).run(stop)` does, in order: serve its status and `/metrics`; learn the region
(and a missing model_id) from the gateway; bind the workflow and check that every role has a policy;
build the sandbox when the workflow runs model-written code (refusing to start without bubblewrap
unless the weaker isolation was configured); show its credentials to the gateway (registering each
policy's stream, so a token bound to another pool's name is caught too) and to the broker, so that a
refused token stops it with one error (exit code 4, docs/CLI.md) before an engine starts or a byte
is downloaded; start one engine per policy; start each policy's weight stream, which resumes from the synced
directory, registers with the gateway and syncs to the head; and run the rollout worker, which
leases only once every engine serves a published version within the staleness bound. Each weight
stream and the worker are their own asyncio loops (the transformers engine decodes in worker
threads), so transfers, swaps and generation overlap. On `stop` the worker drains, then the weight
streams and engines are closed. A weight stream that dies unexpectedly stops the pool: a pool that
cannot follow the trainer must not keep generating.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any, Callable, Mapping, Sequence

from deltamesh.broker_client import BrokerClient
from deltamesh.gateway.fetch.errors import credentials_refused
from deltamesh.gateway_client import GatewayClient
from deltamesh.http import HttpError, client_session, serving
from deltamesh.mesh.engines.base import Engine, SamplingParams
from deltamesh.mesh.pool.batching import BatchingEngine
from deltamesh.mesh.pool.config import PolicyConfig, PoolConfig
from deltamesh.mesh.pool.engine_setup import open_engine
from deltamesh.mesh.pool.metrics import EngineMetricsCollector, PoolMetrics
from deltamesh.mesh.pool.staleness import LeaseGate
from deltamesh.mesh.pool.sync_config import PoolSyncConfig, WeightSyncSettings
from deltamesh.mesh.pool.weight_sync import WeightSync
from deltamesh.mesh.pool.weights import PolicyWeights
from deltamesh.mesh.pool.worker import RolloutWorker
from deltamesh.mesh.sandbox import Sandbox, SandboxError
from deltamesh.mesh.workflows import EpisodeContext, make_workflow
from deltamesh.metrics import service_registry, status_app
from deltamesh.signals import sleep_or_stop

log = logging.getLogger(__name__)


class PoolError(RuntimeError):
    """The pool cannot run as configured (no policy for a workflow role, ambiguous model, ...)."""


def resolve_roles(workflow_roles: Sequence[str], model_ids: Sequence[str], roles: Mapping[str, str]) -> dict[str, str]:
    """Role -> model_id: as configured, else the model_id named like the role, else the only policy."""
    resolved = {}
    for role in workflow_roles:
        if role in roles:
            resolved[role] = roles[role]
        elif role in model_ids:
            resolved[role] = role
        elif len(model_ids) == 1:
            resolved[role] = model_ids[0]
        else:
            raise PoolError(f"no policy plays role {role!r} of the workflow: set roles "
                            f"(--role {role}=MODEL_ID); policies: {list(model_ids)}")
    return resolved


BROKER_CHECK_S = 5.0
"""How long the start-up check of the broker token waits for a broker: the check is there to catch a
refused token early; a broker that does not answer yet is the worker's to wait for."""


async def gateway_info(sync: WeightSyncSettings, stop: asyncio.Event, retry_s: float = 1.0, *,
                       pool: str = "") -> dict[str, Any] | None:
    """The first answer of `GET /v1/models` ({"region", "models"}) from the pool's gateways, asked with its
    token over its TLS settings; None if stopped first. CredentialsError (the one error a refused pool
    stops with, as `pool sync` does) when every gateway refuses the credentials of pool `pool`: asking
    again would not help."""
    async with client_session(timeout_s=10.0, tls=sync.tls) as session:
        while not stop.is_set():
            refused = []
            for url in sync.gateways:
                try:
                    return await GatewayClient(url, session, token=sync.token, insecure=sync.tls.insecure).models()
                except HttpError as e:
                    if e.status in (401, 403):
                        refused.append(str(e))
                    else:
                        log.warning("gateway %s: %s", url, e)
            if len(refused) == len(sync.gateways):
                raise credentials_refused(pool, refused)
            await sleep_or_stop(stop, retry_s)
    return None


class RolloutPool:
    def __init__(self, config: PoolConfig, *, on_weights: Callable[[WeightSync], None] | None = None) -> None:
        self.config = config
        self.on_weights = on_weights
        """Told each policy's weight stream as it is made (the command shows its transfers' progress)."""
        self.registry = service_registry("pool")
        self.metrics = PoolMetrics(self.registry)
        self.region = config.region
        self.url = ""
        self.started_at = time.time()
        self.weights: dict[str, PolicyWeights] = {}
        self.worker: RolloutWorker | None = None
        self.gate: LeaseGate | None = None
        self.sandbox: Sandbox | None = None

    def status(self) -> dict[str, Any]:
        cfg = self.config
        models = {}
        for model_id, w in self.weights.items():
            models[model_id] = {
                "engine_version": w.version, "dir_version": w.sync.version, "head": w.sync.head, "ready": w.ready,
                "resumed_from_dir": w.status.resumed_from_dir, "fetched": w.status.fetched, "swaps": w.status.swaps,
                "last_swap_at": w.status.last_swap_at, "last_error": w.status.last_error,
                "drifted": w.status.drifted, "checks": w.status.checks, "last_check": w.status.last_check,
                "refusals": dict(w.sync.book.refusals), "gateways": w.sync.book.describe(),
                "timeline": w.timeline.describe(),
            }
        worker = dataclasses.asdict(self.worker.counts) if self.worker is not None else {}
        verdict = self.gate.last if self.gate is not None else None
        return {
            "name": cfg.name, "region": self.region, "tier": cfg.sync.tier, "engine": cfg.engine,
            "gpus": cfg.sync.gpus, "started_at": self.started_at, "models": models,
            "leasing": None if verdict is None else {"may_lease": verdict.may_lease, "reason": verdict.reason,
                                                     "behind": verdict.behind},
            "running_episodes": self.worker.running if self.worker is not None else 0, "worker": worker,
            "sandbox": None if self.sandbox is None else {o.value: n for o, n in self.sandbox.counts.items()},
        }

    async def run(self, stop: asyncio.Event) -> None:
        cfg = self.config
        if cfg.threads:
            import torch

            torch.set_num_threads(cfg.threads)
        async with contextlib.AsyncExitStack() as stack:
            self.url = await stack.enter_async_context(serving(status_app(self.registry, self.status), cfg.listen))
            policies = await self._resolve(stop)
            if policies is None:
                return
            workflow = make_workflow(cfg.worker.workflow, cfg.worker.workflow_options)
            model_ids = [p.model_id for p in policies]
            roles = resolve_roles(workflow.roles, model_ids, cfg.worker.roles)
            if workflow.spec.needs_sandbox:
                try:
                    self.sandbox = Sandbox(cfg.sandbox)
                except SandboxError as e:
                    raise PoolError(f"the {workflow.name} workflow runs model-written code: {e}") from e
            client = BrokerClient(cfg.broker, token=cfg.broker_token, tls=cfg.sync.tls,
                                  pool=cfg.name, region=self.region, gpus=cfg.sync.gpus)
            stack.push_async_callback(client.close)
            await self._check_credentials(policies, client)
            # Logged once the credentials are taken: a pool refused says that in one line, and only that.
            log.info("pool %s: status and /metrics at %s", cfg.name, self.url)

            engines: dict[str, Engine] = {}
            registries = []
            for policy in policies:
                engine, registry = await open_engine(cfg.engine, policy, device=cfg.device, max_batch=cfg.max_batch,
                                                     seed=cfg.seed, prefill_chunk_tokens=cfg.prefill_chunk_tokens,
                                                     tensor_parallel_size=cfg.tensor_parallel_size)
                stack.push_async_callback(engine.close)
                engines[policy.model_id] = engine
                registries.append(registry)
            self.registry.register(EngineMetricsCollector(registries))

            for model_id, engine in engines.items():
                self.weights[model_id] = PolicyWeights(engine, self._sync_config(model_id), hot_swap=cfg.hot_swap,
                                                       metrics=self.metrics, check=cfg.check)
                if self.on_weights is not None:
                    self.on_weights(self.weights[model_id].sync)
            generating: dict[str, Engine] = {}
            for model_id, engine in engines.items():
                if engine.supports_in_place and cfg.batch_window_s > 0:
                    engine = await stack.enter_async_context(
                        BatchingEngine(engine, max_prompts=cfg.max_batch, window_s=cfg.batch_window_s))
                generating[model_id] = engine
            s = cfg.sampling
            params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                    top_k=s.top_k, ignore_eos=s.ignore_eos)
            ctx = EpisodeContext(engines=generating, params=params, roles=roles, pool=cfg.name, region=self.region,
                                 sandbox=self.sandbox)
            self.gate = LeaseGate(self.weights, client.status, max_staleness=cfg.worker.max_staleness,
                                  refresh_s=cfg.worker.broker_refresh_s, metrics=self.metrics)
            self.worker = RolloutWorker(client, workflow, ctx, self.gate, cfg.worker, tier=cfg.sync.tier,
                                        metrics=self.metrics)
            await self._run_loops(stop)

    async def _run_loops(self, stop: asyncio.Event) -> None:
        assert self.worker is not None
        failed: list[BaseException] = []

        def watch(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                failed.append(task.exception())  # raised below, as the one error the pool stops with
                log.warning("pool %s: %s ended; stopping (the worker drains first)", self.config.name, task.get_name())
                stop.set()

        streams = []
        for model_id, w in self.weights.items():
            task = asyncio.create_task(w.run(stop), name=f"weights-{model_id}")
            task.add_done_callback(watch)
            streams.append(task)
        try:
            await self.worker.run(stop)
        finally:
            for task in streams:
                task.cancel()
            await asyncio.gather(*streams, return_exceptions=True)
        if failed:
            e = failed[0]
            raise PoolError(f"pool {self.config.name} stopped: {type(e).__name__}: {e}") from e

    async def _resolve(self, stop: asyncio.Event) -> list[PolicyConfig] | None:
        """The policies with their model_ids, and the region, asking the gateway when not configured."""
        cfg = self.config
        policies = list(cfg.models)
        if self.region and all(p.model_id for p in policies):
            return policies
        info = await gateway_info(cfg.sync, stop, pool=cfg.name)
        if info is None:
            return None
        self.region = self.region or str(info.get("region", ""))
        if not policies[0].model_id:
            served = sorted(info.get("models") or {})
            if len(served) != 1:
                raise PoolError(f"the gateway serves {len(served)} models {served}: name one with --model-id")
            policies[0] = dataclasses.replace(policies[0], model_id=served[0])
            log.info("pool %s: serving %s (the gateway's only model)", cfg.name, served[0])
        return policies

    async def _check_credentials(self, policies: Sequence[PolicyConfig], broker: BrokerClient) -> None:
        """Show the pool's tokens before anything starts: each policy's weight stream registers with the
        gateway (`register_once`: a token refused, of another role or bound to another pool's name ends
        the pool with a CredentialsError), and the broker is asked for its status (401/403 end it with a
        PoolError raised from that HttpError). Anything else (a gateway or broker down) is logged and
        left to the loops."""
        for policy in policies:
            async with WeightSync(self._sync_config(policy.model_id)) as sync:
                await sync.register_once()
        try:
            await asyncio.wait_for(broker.status(), BROKER_CHECK_S)
        except HttpError as e:
            if e.status in (401, 403):  # the command's exit code comes from `e` (4)
                raise PoolError(f"pool {self.config.name}: the broker refused its credentials ({e}): check its "
                                "broker token, or its client certificate") from e
            log.warning("pool %s: broker %s: %s", self.config.name, broker.base, e)
        except asyncio.TimeoutError:
            log.warning("pool %s: broker %s did not answer within %g s", self.config.name, broker.base, BROKER_CHECK_S)

    def _sync_config(self, model_id: str) -> PoolSyncConfig:
        cfg = self.config
        # The pool's [pool.sync] section, plus what is this policy's own: its name, directory and model.
        # Field by field, not dataclasses.asdict, which would turn the nested TLS settings into a dict.
        shared = {f.name: getattr(cfg.sync, f.name) for f in dataclasses.fields(cfg.sync)}
        return PoolSyncConfig(**shared, name=cfg.registration_name(model_id),
                              dir=str(cfg.policy_dir(model_id)), model=model_id, engine=cfg.engine,
                              endpoint=cfg.advertise or self.url)

