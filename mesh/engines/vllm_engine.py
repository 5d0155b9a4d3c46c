"""The vLLM rollout engine: an in-process vLLM engine core, stepped by this adapter, with in-place updates.

vLLM (`pip install deltamesh[vllm]`; its CPU build here, CUDA builds on GPU hosts speak the same
Python API) runs in this process: an `LLMEngine` whose engine core and single worker live here too
(`multiprocess_mode=False`), so weight updates reach the worker by reference. This adapter drives
it step by step: one task calls `LLMEngine.step()` while requests are pending, each step under the
engine's step lock, and tags the tokens of each step with the version live during it; a weight
update takes the same lock, so it lands between two steps, and running requests carry on with the
new weights over the KV cache built so far, exactly as in the transformers engine. Asynchronous
scheduling is off, so a step's output comes from that step's forward pass, and prefix caching is off
by default, so no new request reuses KV computed with weights older than the served version.

Weights: the engine keeps a host copy of the checkpoint tensors (bf16 on the CPU, the layout of the
model directory) whose `weights_hash` it knows. `apply_update` applies the pool's verified, decoded
delta to the host copy in place with the codec's one applier (`deltamesh.delta.apply_version`, which
checks the base and every resulting hash and undoes its writes if one is wrong) while generation goes
on, after saving the tensors it changes into a spare buffer allocated once (writing only the changed
words is ~4x faster here than building new tensors, whose fresh pages dominate); then it pauses
generation only for vLLM's own in-place reload of the layers the version touched (`vllm_weights.py`).
A full snapshot goes the same way with every layer, from its own decoded tensors. `load_version` verifies the directory, then lets vLLM
reload it from disk (`reload_weights(weights_path=...)`). If vLLM fails part way, the previous host
tensors of the same layers are written back; if even that fails, the engine refuses to generate
until a `load_version` succeeds (the pool then reloads from its directory). `served_digests` hashes
what vLLM itself holds (`VLLMWeights.digests`), not the host copy, so the pool's check after a swap
sees a layer vLLM did not take.

Behaviour logprobs are vLLM's `processed_logprobs`: log_softmax(logits / temperature), as the engine
contract says, except that with top-p/top-k truncation vLLM reports them over the truncated,
renormalised distribution.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import torch
from prometheus_client import CollectorRegistry

from deltamesh.delta import BaseMismatchError, CorruptError, DecodedVersion, Grid, Manifest, dir_manifest, read_weights
from deltamesh.mesh.engines.base import EngineError, Generation, SamplingParams, ServedDigests
from deltamesh.mesh.engines.host_weights import HostWeights
from deltamesh.mesh.engines.local import LocalEngine, check_engine_settings, checked_prompts, eos_ids, read_verified
from deltamesh.mesh.engines.metrics import EngineMetrics
from deltamesh.mesh.engines.vllm_weights import VLLMWeights
from deltamesh.trainer.models import load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class VLLMEngineConfig:
    model_id: str
    model_dir: str
    """A Hugging Face model directory (config, tokenizer, safetensors)."""
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    version: int | None = None
    """Version of the weights in `model_dir`; None takes it from the directory's manifest, else 0."""
    max_batch: int = 64
    """Most sequences vLLM runs at once (`max_num_seqs`)."""
    seed: int | None = 0
    """vLLM's sampling seed (None: random); a request's own seed overrides it."""
    gpu_memory_utilization: float = 0.08
    """Share of GPU memory (on the CPU build: of host RAM) vLLM may take."""
    kv_cache_bytes: int | None = 512 << 20
    """KV cache size; None lets vLLM size it from `gpu_memory_utilization`. In-process on a CPU, vLLM
    counts this whole process's memory as its own, so an explicit size is the dependable choice."""
    max_model_len: int | None = None
    """Longest prompt + completion (None: the model's)."""
    enforce_eager: bool = True
    """No CUDA graphs / compilation: faster start, which tests and small pools want."""
    prefix_caching: bool = False
    """Reuse KV across requests with a common prefix. Off by default: after a swap, cached KV from the
    old weights would be reused by new requests."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """More `vllm.EngineArgs` fields, passed as they are."""

    def __post_init__(self) -> None:
        check_engine_settings(self.model_id, self.max_batch, self.version)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class _Request:
    gen: Generation
    done: asyncio.Future


class VLLMEngine(LocalEngine):
    """In-process vLLM engine (see the module docstring). Construction starts vLLM and blocks."""

    def __init__(self, config: VLLMEngineConfig, *, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.model_id = config.model_id
        manifest = dir_manifest(config.model_dir)
        if manifest is not None and config.version is not None and manifest.version != config.version:
            raise EngineError(f"{config.model_dir} holds v{manifest.version}, config says v{config.version}")
        self._version = manifest.version if manifest is not None else (config.version or 0)
        self._engine = _start_vllm(config)
        try:
            self._open_weights(manifest)
        except BaseException:
            self._engine.engine_core.shutdown()
            raise
        self._tokenizer = load_tokenizer(config.model_dir)
        generation_eos = self._engine.model_config.hf_config.eos_token_id
        self._eos = eos_ids(self._tokenizer.eos_token_id, generation_eos)
        self._vocab = int(self._engine.model_config.get_vocab_size())
        self._lock = asyncio.Lock()  # one engine step or one weight write at a time
        self._update_lock = asyncio.Lock()  # one update of the host copy at a time
        self._requests: dict[str, _Request] = {}
        self._ids = itertools.count()
        self._driver: asyncio.Task | None = None
        self._closed = False
        self._weights_lost = ""  # why vLLM's weights are unknown (a failed update could not be undone)
        self.metrics = EngineMetrics(self.model_id, "vllm", registry)
        self.metrics.version.set(self._version)
        log.info("%s: vLLM engine serving v%d from %s", self.model_id, self._version, config.model_dir)

    def _open_weights(self, manifest: Manifest | None) -> None:
        """The weights side, once vLLM has started: the host copy of the whole checkpoint and vLLM's
        in-place reload of it (a tensor-parallel engine keeps a share per rank instead: vllm_ranks.py)."""
        self._host = HostWeights(read_weights(self.config.model_dir), manifest.weights_hash if manifest is not None else None)
        self._weights = VLLMWeights(self._engine, self._host.weights)

    # -- the Engine interface --------------------------------------------------------------------
    @property
    def last_reload_s(self) -> float:
        """Seconds the last update spent inside vLLM's reload (its re-processing of the layers)."""
        return self._weights.last_reload_s

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        self._check_serving()
        prompts = checked_prompts(prompts, self._vocab)
        started = time.perf_counter()
        ids = [f"{self.model_id}-{next(self._ids)}" for _ in prompts]
        loop = asyncio.get_running_loop()
        requests = [_Request(Generation(prompt=p), loop.create_future()) for p in prompts]
        async with self._lock:
            self._check_serving()
            await asyncio.to_thread(self._add, ids, prompts, _vllm_params(params))
            self._requests.update(zip(ids, requests))
        if self._driver is None or self._driver.done():
            self._driver = asyncio.create_task(self._drive())
        try:
            await asyncio.gather(*(r.done for r in requests))
        finally:
            unfinished = [i for i in ids if i in self._requests]
            if unfinished:  # cancelled, or the engine failed: vLLM must not keep running them
                async with self._lock:
                    for i in unfinished:
                        self._requests.pop(i, None)
                    self._engine.abort_request(unfinished)
        gens = [r.gen for r in requests]
        for gen in gens:
            gen.generate_s = time.perf_counter() - started
            if len(set(gen.versions)) > 1:
                self.metrics.straddled.inc()
        self.metrics.generations.inc(len(gens))
        self.metrics.tokens.inc(sum(len(g.tokens) for g in gens))
        return gens

    async def load_version(self, path: str | Path, version: int) -> None:
        """Verify the directory `path` (read into the host copy while generation goes on), then let
        vLLM reload every layer from it."""
        self._check_open()
        async with self._update_lock:
            weights, manifest = await asyncio.to_thread(read_verified, Path(path), version)
            if set(weights) != set(self._host.weights):
                self.metrics.update_done("disk", False, 0.0)
                raise CorruptError(f"{path}: tensors differ from the model's")
            names = self._weights.layer_groups(self._host.weights)
            seconds = await self._write(lambda: self._weights.load_dir(str(path)), names, "disk", self._host.weights)
            self._host.commit(weights, manifest.weights_hash if manifest is not None else None)
            self._set_version(version)
        log.info("%s: now serving v%d from %s (%.3f s paused)", self.model_id, version, path, seconds)

    async def apply_update(self, version: DecodedVersion) -> None:
        """Apply decoded delta or full snapshot `version` to the host copy, then swap the layers it
        touches into vLLM between two engine steps."""
        self._check_serving()
        manifest = version.manifest
        if manifest.model_id != self.model_id:
            raise BaseMismatchError(f"update is for model {manifest.model_id!r}, engine serves {self.model_id!r}")
        async with self._update_lock:
            try:
                # A full snapshot's every tensor goes to vLLM: its reload works by whole layers anyway.
                result, changed = await asyncio.to_thread(self._host.apply, version, self._version, diff=False)
            except Exception:
                self.metrics.update_done(manifest.kind, False, 0.0)
                raise
            names = self._weights.layer_groups(changed)
            # Until vLLM has taken it, the previous version is the host copy with the delta undone.
            before = {**self._host.weights, **self._host.previous()}
            try:
                seconds = await self._write(lambda: self._weights.load(result, names), names, manifest.kind, before)
            except Exception:
                self._host.undo(version)  # the host copy goes back to the version served
                raise
            self._host.commit(result, manifest.weights_hash, adopted=manifest.kind == "full")
            self._set_version(manifest.version)
        log.info("%s: swapped in %s v%d in place (%d of %d tensors to vLLM, %.3f s paused, %.3f s in vLLM)",
                 self.model_id, manifest.kind, manifest.version, len(names), len(result), seconds,
                 self._weights.last_reload_s)

    async def served_digests(self, names: Sequence[str], grids: Mapping[str, Grid] | None = None) -> ServedDigests:
        """Hash vLLM's own parameters by checkpoint tensor (`ReadsBack`), between two engine steps and
        never while an update is under way."""
        self._check_serving()
        async with self._update_lock, self._lock:
            digests = await asyncio.to_thread(self._weights.digests, list(names), self._host.weights, grids or {})
            return ServedDigests(self._version, digests)

    async def close(self) -> None:
        async with self._lock:
            if self._closed:
                return
            self._closed = True
            for request in self._requests.values():
                if not request.done.done():
                    request.done.set_exception(EngineError(f"{self.model_id}: engine closed"))
            self._requests.clear()
            await asyncio.to_thread(self._engine.engine_core.shutdown)

    # -- internals -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"{self.model_id}: engine is closed")

    def _check_serving(self) -> None:
        self._check_open()
        if self._weights_lost:
            raise EngineError(f"{self.model_id}: weights unknown until a full reload ({self._weights_lost})")

    def _add(self, ids: list[str], prompts: list[list[int]], params: Any) -> None:
        rendered = self._engine.renderer.render_cmpl([{"prompt_token_ids": p} for p in prompts])
        for request_id, prompt in zip(ids, rendered):
            self._engine.add_request(request_id, prompt, params)

    async def _drive(self) -> None:
        """Step vLLM while requests are pending, routing each step's new tokens to their generations.
        Whatever fails here fails every waiting generate call: none is left waiting on a driver that
        has stopped."""
        try:
            while self._requests:
                async with self._lock:
                    if self._closed:
                        return
                    version = self._version
                    outputs = await asyncio.to_thread(self._engine.step)
                for out in outputs:
                    request = self._requests.get(out.request_id)
                    if request is not None:
                        self._take(out, request, version)
        except Exception as e:  # noqa: BLE001 - every waiting generate call gets the error
            log.exception("%s: vLLM step failed", self.model_id)
            for request in self._requests.values():
                if not request.done.done():
                    request.done.set_exception(EngineError(f"{self.model_id}: vLLM step failed: {e}"))

    def _take(self, out: Any, request: _Request, version: int) -> None:
        completion, gen = out.outputs[0], request.gen
        tokens = list(completion.token_ids)
        gen.tokens += tokens
        gen.logprobs += [float(step[t].logprob) for step, t in zip(completion.logprobs or [], tokens)]
        gen.versions += [version] * len(tokens)
        if not out.finished:
            return
        self._requests.pop(out.request_id, None)
        if request.done.done():
            return  # its generate call was cancelled while this step ran
        if completion.finish_reason not in ("stop", "length") or len(gen.logprobs) != len(gen.tokens):
            request.done.set_exception(EngineError(
                f"{self.model_id}: vLLM ended a request with {completion.finish_reason!r} "
                f"({len(gen.tokens)} tokens, {len(gen.logprobs)} logprobs)"))
            return
        gen.finish_reason = completion.finish_reason
        request.done.set_result(None)

    async def _write(self, write: Any, names: list[str], way: str, before: dict[str, torch.Tensor]) -> float:
        """Run `write` (a call into vLLM) between two engine steps; if it fails, put the tensors of
        layers `names` back from `before`, the weights served so far (or, failing that, refuse to
        serve until a full reload)."""
        async with self._lock:
            paused = time.perf_counter()
            try:
                await asyncio.to_thread(write)
            except Exception as e:
                self.metrics.update_done(way, False, 0.0)
                try:
                    await asyncio.to_thread(self._weights.restore, before, names)
                except Exception as again:  # noqa: BLE001 - reported through the engine's state
                    self._weights_lost = f"restoring v{self._version} after a failed update failed: {again}"
                    log.exception("%s: %s", self.model_id, self._weights_lost)
                raise EngineError(f"{self.model_id}: vLLM failed to take the update ({type(e).__name__}: {e}); "
                                  f"{'weights lost' if self._weights_lost else f'still serving v{self._version}'}") from e
            self._weights_lost = ""
        seconds = time.perf_counter() - paused
        self.metrics.update_done(way, True, seconds)
        return seconds

    def _set_version(self, version: int) -> None:
        self._version = version
        self.metrics.version.set(version)


def _vllm_params(params: SamplingParams) -> Any:
    from vllm import SamplingParams as VParams
    from vllm.sampling_params import RequestOutputKind

    return VParams(
        max_tokens=params.max_new_tokens, temperature=params.temperature, top_p=params.top_p, top_k=params.top_k,
        stop_token_ids=list(params.stop_token_ids), ignore_eos=params.ignore_eos, seed=params.seed,
        logprobs=0,  # the sampled token's own logprob only
        output_kind=RequestOutputKind.DELTA, detokenize=False,
    )


def _start_vllm(config: VLLMEngineConfig) -> Any:
    """An `LLMEngine` whose engine core and worker run in this process: updates hand tensors to the
    worker by reference."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.llm_engine import LLMEngine
    from vllm.v1.executor import Executor

    args = EngineArgs(
        model=config.model_dir, dtype=config.dtype, seed=config.seed if config.seed is not None else secrets.randbits(31),
        max_num_seqs=config.max_batch, gpu_memory_utilization=config.gpu_memory_utilization,
        kv_cache_memory_bytes=config.kv_cache_bytes, max_model_len=config.max_model_len,
        enforce_eager=config.enforce_eager, enable_prefix_caching=config.prefix_caching,
        logprobs_mode="processed_logprobs", async_scheduling=False, disable_log_stats=True, **config.engine_args,
    )
    # vLLM's CPU platform picks a worker process over the in-process executor unless this variable
    # says "0" (read when the config is made; the GPU platforms follow `multiprocess_mode` below).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # Unless OMP_NUM_THREADS is set, vLLM drops this process's torch threads to 1 "for serving", which
    # in process halves its own decode speed here (2 cores) and slows the pool's other torch work.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    vllm_config = args.create_engine_config(UsageContext.ENGINE_CONTEXT)
    return LLMEngine(vllm_config=vllm_config, executor_class=Executor.get_class(vllm_config), log_stats=False,
                     usage_context=UsageContext.ENGINE_CONTEXT, multiprocess_mode=False)
