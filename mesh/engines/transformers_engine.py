"""The in-process rollout engine: a transformers causal LM on CPU or CUDA, with hot weight swap.

Generation is a custom decode loop (left-padded batch, attention mask, explicit positions, KV cache)
rather than `model.generate`, because weights may change between two forward passes: every pass (a
decoding step, or a chunk of the prompts' prefill, `prefill_chunk_tokens`) runs under the engine's
step lock, and a weight update takes the same lock ahead of queued passes (`StepLock`), so an update
lands exactly at a pass boundary, after waiting for the pass in progress only. Reading
the weights back for the pool's check only has to keep writers out: it takes the write lock alone,
which every update holds too, and hashes beside the decode steps rather than between them. Each
token is tagged with the version that was live when its step ran; in-flight generations carry on
with the new weights over the KV cache built so far. The pool verifies and decodes a version before
handing it over (`DecodedVersion`), so generation pauses only for the in-place write and the hash
check, both done by the codec's one applier (`deltamesh.delta.swap_in_place`), which restores every
written word if the result does not hash right.

Calls that touch the model run in a worker thread (`asyncio.to_thread`) under `torch.inference_mode`,
keeping the pool's event loop free for network I/O meanwhile.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import torch
from prometheus_client import CollectorRegistry

from deltamesh.delta import (
    BaseMismatchError,
    DecodedVersion,
    Grid,
    Manifest,
    SmallWordIndex,
    TensorEntry,
    copy_in,
    dir_manifest,
    live_hash,
    live_tensors,
    swap_in_place,
    tensor_digests,
)
from deltamesh.mesh.engines.base import EngineError, Generation, SamplingParams, ServedDigests
from deltamesh.mesh.engines.local import LocalEngine, check_engine_settings, checked_prompts, eos_ids, read_verified
from deltamesh.mesh.engines.metrics import EngineMetrics
from deltamesh.mesh.engines.sampling import sample_next
from deltamesh.mesh.engines.step_lock import StepLock
from deltamesh.trainer.models import load_causal_lm, load_tokenizer

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class TransformersEngineConfig:
    model_id: str
    model_dir: str
    """A Hugging Face model directory (config, tokenizer, safetensors)."""
    device: str = "cpu"
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    version: int | None = None
    """Version of the weights in `model_dir`; None takes it from the directory's manifest, else 0."""
    max_batch: int = 64
    """Most prompts decoded together; larger requests run in consecutive batches."""
    seed: int | None = 0
    """Seed of the engine's sampling generator (None: random); a request's own seed overrides it."""
    prefill_chunk_tokens: int = 128
    """Prompt tokens (rows x columns) per prefill pass; 0 prefills a batch in one pass. A weight update
    waits for the pass in progress, so one long prefill would hold a version back for seconds."""

    def __post_init__(self) -> None:
        check_engine_settings(self.model_id, self.max_batch, self.version)
        if self.prefill_chunk_tokens < 0:
            raise ValueError(f"prefill_chunk_tokens must be >= 0, got {self.prefill_chunk_tokens}")
        torch.device(self.device)  # raises on a malformed device string


@dataclass
class _DecodeState:
    """The batch being decoded: inputs not yet in the KV cache (from column `fed` on), the attention
    mask over cache and inputs, positions, the cache, and the prompt's remaining prefill cuts."""

    inputs: torch.Tensor
    mask: torch.Tensor
    positions: torch.Tensor
    cache: Any = None
    done: list[bool] = field(default_factory=list)
    fed: int = 0
    cuts: list[int] = field(default_factory=list)


class TransformersEngine(LocalEngine):
    """In-process engine (see the module docstring). Construction loads the model and blocks."""

    def __init__(self, config: TransformersEngineConfig, *, registry: CollectorRegistry | None = None) -> None:
        self.config = config
        self.model_id = config.model_id
        self._device = torch.device(config.device)
        self._model = load_causal_lm(config.model_dir, dtype=_DTYPES[config.dtype], device=config.device)
        self._tokenizer = load_tokenizer(config.model_dir)
        self._live = live_tensors(self._model)
        forward = inspect.signature(self._model.forward).parameters
        # transformers 5 renamed `past_key_values` to `cache`; use whichever this version takes.
        self._cache_arg = "cache" if "cache" in forward else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in forward
        self._eos = eos_ids(self._tokenizer.eos_token_id, self._model.generation_config.eos_token_id)
        pad = self._tokenizer.pad_token_id
        self._pad = int(pad if pad is not None else (self._eos[0] if self._eos else 0))
        self._vocab = int(self._model.get_output_embeddings().weight.shape[0])
        seed = config.seed if config.seed is not None else secrets.randbits(63)
        self._generator = torch.Generator(device=self._device).manual_seed(seed)
        self._lock = StepLock()
        # Held by whatever writes the weights, around `_lock`: the read-back waits for writers only.
        self._write_lock = asyncio.Lock()
        self._closed = False
        manifest = dir_manifest(config.model_dir)
        if manifest is not None and config.version is not None and manifest.version != config.version:
            raise EngineError(f"{config.model_dir} holds v{manifest.version}, config says v{config.version}")
        self._version = manifest.version if manifest is not None else (config.version or 0)
        self._weights_hash = manifest.weights_hash if manifest is not None else None
        self._verified_digests = _digests_of(manifest)
        self._small_index = SmallWordIndex()  # moved along by each in-place delta: see deltamesh.delta
        self.metrics = EngineMetrics(self.model_id, "transformers", registry)
        self.metrics.version.set(self._version)
        log.info("%s: transformers engine on %s serving v%d from %s", self.model_id, self._device,
                 self._version, config.model_dir)

    # -- the Engine interface --------------------------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self._model

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        self._check_open()
        prompts = checked_prompts(prompts, self._vocab)
        results: list[Generation] = []
        for start in range(0, len(prompts), self.config.max_batch):
            results += await self._generate_batch(prompts[start:start + self.config.max_batch], params)
        return results

    async def load_version(self, path: str | Path, version: int) -> None:
        """Read and verify the weights of `path` (while generation goes on), then copy them in."""
        self._check_open()
        started = time.perf_counter()
        try:
            weights, manifest = await asyncio.to_thread(read_verified, Path(path), version)
            async with self._write_lock, self._lock.write():
                paused = time.perf_counter()
                await asyncio.to_thread(copy_in, self._live, weights)
                self._small_index.clear()
                self._set_version(version, manifest)
        except Exception:
            self.metrics.update_done("disk", False, 0.0)
            raise
        self.metrics.update_done("disk", True, time.perf_counter() - paused)
        log.info("%s: now serving v%d from %s (%.3f s, %.3f s paused)", self.model_id, version, path,
                 time.perf_counter() - started, time.perf_counter() - paused)

    async def apply_update(self, version: DecodedVersion) -> None:
        """Hot-swap decoded delta or full snapshot `version` into the live model between two decode steps."""
        self._check_open()
        manifest = version.manifest
        if manifest.model_id != self.model_id:
            raise BaseMismatchError(f"update is for model {manifest.model_id!r}, engine serves {self.model_id!r}")
        try:
            async with self._write_lock, self._lock.write():
                paused = time.perf_counter()
                base_hash = await asyncio.to_thread(self._check_base, manifest) if manifest.kind == "delta" else None
                stats = await asyncio.to_thread(swap_in_place, self._live, version, base_hash=base_hash,
                                                base_entries=self._verified_digests, small_index=self._small_index)
                self._set_version(manifest.version, manifest)
        except Exception:
            self.metrics.update_done(manifest.kind, False, 0.0)
            raise
        seconds = time.perf_counter() - paused
        self.metrics.update_done(manifest.kind, True, seconds)
        if manifest.kind == "delta":
            log.info("%s: hot-swapped v%d -> v%d in place (%d words in %d tensors, %.3f s paused)", self.model_id,
                     manifest.base_version, manifest.version, stats.words_changed, stats.tensors_written, seconds)
        else:
            log.info("%s: swapped in full snapshot v%d (%.3f s paused)", self.model_id, manifest.version, seconds)

    async def served_digests(self, names: Sequence[str], grids: Mapping[str, Grid] | None = None) -> ServedDigests:
        """Hash the live tensors the forward pass reads (`ReadsBack`), with no update under way (decode
        steps only read them too: they go on)."""
        self._check_open()
        async with self._write_lock:
            self._check_open()  # closed while this waited
            digests = await asyncio.to_thread(self._digests, list(names), grids or {})
            return ServedDigests(self._version, digests)

    async def close(self) -> None:
        async with self._write_lock, self._lock.write():
            self._closed = True
            self._live = {}
        if self._device.type == "cuda":
            torch.cuda.empty_cache()

    # -- internals -------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise EngineError(f"{self.model_id}: engine is closed")

    def _check_base(self, manifest: Manifest) -> str:
        """The `weights_hash` of the served weights, once delta `manifest` is known to apply onto them
        (hashing the live model the first time, when they did not come with a manifest)."""
        if manifest.base_version != self._version:
            raise BaseMismatchError(f"{manifest.model_id} v{manifest.version} is a delta from "
                                    f"v{manifest.base_version}, the engine serves v{self._version}")
        if self._weights_hash is None:
            self._weights_hash = live_hash(self._live, manifest)
        if manifest.base_hash != self._weights_hash:
            raise BaseMismatchError(f"{manifest.model_id} v{manifest.version}: its base v{manifest.base_version} has "
                                    f"weights {manifest.base_hash}, the engine serves {self._weights_hash}")
        return self._weights_hash

    def _set_version(self, version: int, manifest: Manifest | None) -> None:
        self._version = version
        self._weights_hash = manifest.weights_hash if manifest is not None else None
        self._verified_digests = _digests_of(manifest)
        self.metrics.version.set(version)

    def _digests(self, names: list[str], grids: Mapping[str, Grid]) -> dict[str, str | None]:
        found = tensor_digests({name: self._live[name] for name in names if name in self._live}, grids)
        return {name: found.get(name) for name in names}

    async def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        started = time.perf_counter()
        gens = [Generation(prompt=p) for p in prompts]
        state = _start_state(prompts, self._pad, self._device, self.config.prefill_chunk_tokens)
        generator = self._generator
        if params.seed is not None:
            generator = torch.Generator(device=self._device).manual_seed(params.seed)
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop |= set(self._eos)
        prefilled_on: set[int] = set()
        while state.cuts:
            async with self._lock.passes():
                self._check_open()
                prefilled_on.add(self._version)
                await asyncio.to_thread(self._prefill, state)
        for _ in range(params.max_new_tokens):
            async with self._lock.passes():
                self._check_open()
                version = self._version
                tokens, logprobs = await asyncio.to_thread(self._step, state, params, generator)
            for i, gen in enumerate(gens):
                if state.done[i]:
                    continue
                gen.tokens.append(tokens[i])
                gen.logprobs.append(logprobs[i])
                gen.versions.append(version)
                if tokens[i] in stop:
                    gen.finish_reason = "stop"
                    state.done[i] = True
            if all(state.done):
                break
        elapsed = time.perf_counter() - started
        for gen in gens:
            gen.generate_s = elapsed
            if len(prefilled_on | set(gen.versions)) > 1:
                self.metrics.straddled.inc()
        self.metrics.generations.inc(len(gens))
        self.metrics.tokens.inc(sum(len(g.tokens) for g in gens))
        return gens

    def _forward(self, state: _DecodeState, end: int) -> Any:
        """Feeds input columns `fed..end` into the KV cache; returns the model's output."""
        kwargs: dict[str, Any] = {self._cache_arg: state.cache, "use_cache": True}
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        past = state.mask.shape[1] - state.inputs.shape[1]
        out = self._model(input_ids=state.inputs[:, state.fed:end], attention_mask=state.mask[:, :past + end],
                          position_ids=state.positions[:, state.fed:end], **kwargs)
        state.cache = out[self._cache_arg]
        state.fed = end
        return out

    def _prefill(self, state: _DecodeState) -> None:
        """One prefill pass up to the next cut, sampling nothing."""
        with torch.inference_mode():
            self._forward(state, state.cuts.pop(0))

    def _step(
        self, state: _DecodeState, params: SamplingParams, generator: torch.Generator,
    ) -> tuple[list[int], list[float]]:
        """One forward pass and one sampled token per row; prepares the next step's inputs."""
        with torch.inference_mode():
            out = self._forward(state, state.inputs.shape[1])
            tokens, logprobs = sample_next(out.logits[:, -1, :], params, generator)
            done = torch.tensor(state.done, device=self._device)
            # Finished rows keep stepping (a batch moves together) on padding whose outputs are ignored.
            state.inputs = tokens.masked_fill(done, self._pad)[:, None]
            state.fed = 0
            state.positions = state.positions[:, -1:] + 1
            state.mask = torch.cat([state.mask, state.mask.new_ones((state.mask.shape[0], 1))], dim=1)
        return tokens.tolist(), logprobs.tolist()


def _start_state(prompts: list[list[int]], pad: int, device: torch.device, chunk_tokens: int) -> _DecodeState:
    """Left-pad the prompts; positions count real tokens only, so padding does not shift them. The
    first prefill pass takes every padding column with the first real token of each row, as an
    unchunked prefill does; a later pass would otherwise hold query rows that attend to nothing."""
    width = max(len(p) for p in prompts)
    inputs = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        inputs[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    cuts: list[int] = []
    if chunk_tokens:
        step = max(1, chunk_tokens // len(prompts))
        cuts = list(range(max(width - min(len(p) for p in prompts) + 1, step), width, step))
    return _DecodeState(inputs.to(device), mask.to(device), positions.to(device), done=[False] * len(prompts),
                        cuts=cuts)


def _digests_of(manifest: Manifest | None) -> dict[str, TensorEntry] | None:
    """The tensor entries of the manifest the live weights were verified against: the next delta's
    base check, and the digests of the tensors it leaves alone, without hashing them."""
    return None if manifest is None else manifest.entries()
