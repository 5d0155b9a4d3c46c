"""The evaluator process (`deltamesh eval`): engine, held-out set, results store, server and the scoring loop.

`run_evaluator(config, stop)` does, in order: open the results store; build the held-out set and bind
the workflow that scores it (single-role; a code workflow gets its sandbox, as a pool's does); start
the engine (an in-process engine behind the pool's batcher, so the held-out problems of one version
decode together); serve results, requests, status and `/metrics`; then run the evaluator until
`stop`. The trainer and the broker are never contacted.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from aiohttp import web

from deltamesh.http import serving
from deltamesh.mesh.engines.base import Engine, SamplingParams
from deltamesh.mesh.eval.config import EvalConfig
from deltamesh.mesh.eval.evaluator import Evaluator
from deltamesh.mesh.eval.heldout import heldout_records, heldout_tasks, set_digest
from deltamesh.mesh.eval.metrics import EvalMetrics
from deltamesh.mesh.eval.server import eval_app
from deltamesh.mesh.eval.store import EvalStore
from deltamesh.mesh.pool.batching import BatchingEngine
from deltamesh.mesh.pool.config import PolicyConfig
from deltamesh.mesh.pool.engine_setup import open_engine
from deltamesh.mesh.pool.metrics import EngineMetricsCollector, PoolMetrics
from deltamesh.mesh.sandbox import Sandbox, SandboxError
from deltamesh.mesh.workflows import EpisodeContext, make_workflow
from deltamesh.metrics import service_registry
from deltamesh.tls import server_context

log = logging.getLogger(__name__)


class EvalError(RuntimeError):
    """The evaluator cannot run as configured (a multi-role workflow, no sandbox for code)."""


async def run_evaluator(config: EvalConfig, stop: asyncio.Event) -> None:
    if config.threads:
        import torch

        torch.set_num_threads(config.threads)
    workflow = make_workflow(config.workflow, config.workflow_options)
    if len(workflow.roles) != 1:
        raise EvalError(f"the evaluator scores one policy; workflow {workflow.name} has roles {list(workflow.roles)}")
    sandbox = None
    if workflow.spec.needs_sandbox:
        try:
            sandbox = Sandbox(config.sandbox)
        except SandboxError as e:
            raise EvalError(f"the {workflow.name} workflow runs model-written code: {e}") from e
    records = heldout_records(config.heldout)
    heldout = set_digest(records)
    tasks = heldout_tasks(records, config.samples)
    store = EvalStore(config.db)
    registry = service_registry("eval")
    metrics = EvalMetrics(registry)
    async with contextlib.AsyncExitStack() as stack:
        stack.callback(store.close)
        engine, engine_registry = await open_engine(
            config.engine, PolicyConfig(model_id=config.model_id, model_path=config.model_path),
            device=config.device, max_batch=config.max_batch, seed=config.seed)
        stack.push_async_callback(engine.close)
        registry.register(EngineMetricsCollector([engine_registry]))
        generating: Engine = engine
        if engine.supports_in_place:
            generating = await stack.enter_async_context(BatchingEngine(engine, max_prompts=config.max_batch))
        s = config.sampling
        params = SamplingParams(max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                top_k=s.top_k, ignore_eos=s.ignore_eos)
        ctx = EpisodeContext(engines={config.model_id: generating}, params=params, pool=config.name,
                             region="eval", sandbox=sandbox)
        evaluator: Evaluator | None = None

        def status() -> dict:
            return evaluator.status() if evaluator is not None else {"model_id": config.model_id, "starting": True}

        def request(version: int) -> bool:
            if evaluator is None:
                raise web.HTTPServiceUnavailable(text=json.dumps({"error": "the evaluator is starting"}),
                                                 content_type="application/json")
            return evaluator.request(version)

        app = eval_app(config, store, registry, status=status, request=request, heldout=heldout)
        url = await stack.enter_async_context(serving(app, config.listen, ssl_context=server_context(config.tls)))
        evaluator = Evaluator(config, engine, workflow, ctx, tasks, heldout, store, metrics, PoolMetrics(registry),
                              endpoint=url)
        log.info("evaluator %s: scoring %s on %d held-out problems (%s, set %s) x %d samples, every %d versions; "
                 "results at %s/v1/evals", config.name, config.model_id, len(tasks), config.heldout.family, heldout,
                 config.samples, config.every, url)
        await evaluator.run(stop)
