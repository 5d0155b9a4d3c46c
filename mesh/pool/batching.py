"""Merging the generate calls of concurrent episodes into shared engine batches.

A pool runs several episodes at once and each calls `generate` for its own few prompts (one task's
samples). The in-process transformers engine decodes each call as its own batch, so calls that run
side by side would take turns step by step. `BatchingEngine` sits in front of such an engine: calls
that arrive while a batch is decoding (or within `window_s` of an idle engine) are queued, and the
next batch takes every queued call with the same sampling parameters, up to `max_prompts` prompts,
as ONE engine call whose results are split back per caller. A call with its own seed runs alone (its
sampling must stay reproducible). If a merged call fails, each of its callers is retried alone, so
one bad prompt fails only its own episode. Weight updates do not pass through here: the pool's
weight sync talks to the engine itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from deltamesh.mesh.engines.base import Engine, Generation, SamplingParams

if TYPE_CHECKING:
    from deltamesh.delta import DecodedVersion

log = logging.getLogger(__name__)


@dataclass
class _Call:
    prompts: list[list[int]]
    params: SamplingParams
    future: asyncio.Future = field(repr=False)


class BatchingEngine:
    """An `Engine` whose `generate` merges concurrent calls (see the module docstring).

    Use as `async with BatchingEngine(engine, ...) as batched:`; closing it does not close `engine`.
    """

    def __init__(self, engine: Engine, *, max_prompts: int = 64, window_s: float = 0.005) -> None:
        if max_prompts < 1 or window_s < 0:
            raise ValueError("max_prompts must be >= 1 and window_s >= 0")
        self.inner = engine
        self.model_id = engine.model_id
        self.max_prompts = max_prompts
        self.window_s = window_s
        self.batches = 0
        """Engine calls made so far (each serving one or more generate calls)."""
        self._queue: list[_Call] = []
        self._wake = asyncio.Event()
        self._server: asyncio.Task[None] | None = None

    async def __aenter__(self) -> "BatchingEngine":
        self._server = asyncio.create_task(self._serve(), name=f"batcher-{self.model_id}")
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._server
            self._server = None
        for call in self._queue:
            if not call.future.done():
                call.future.set_exception(RuntimeError(f"{self.model_id}: batcher closed"))
        self._queue.clear()

    # -- the Engine interface: generation is merged, everything else goes straight through ----------
    @property
    def version(self) -> int:
        return self.inner.version

    @property
    def supports_in_place(self) -> bool:
        return self.inner.supports_in_place

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.inner.eos_token_ids

    @property
    def tokenizer(self) -> Any:
        return self.inner.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.inner.encode(text)

    def decode(self, tokens: Sequence[int]) -> str:
        return self.inner.decode(tokens)

    async def generate(self, prompts: Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        if not prompts:
            return []
        if self._server is None:
            raise RuntimeError(f"{self.model_id}: use the batcher inside `async with`")
        call = _Call([list(p) for p in prompts], params, asyncio.get_running_loop().create_future())
        self._queue.append(call)
        self._wake.set()
        return await call.future

    async def load_version(self, path: str | Path, version: int) -> None:
        await self.inner.load_version(path, version)

    async def apply_update(self, version: "DecodedVersion") -> None:
        await self.inner.apply_update(version)

    async def close(self) -> None:
        await self.__aexit__(None, None, None)

    # -- internals -------------------------------------------------------------------------------
    async def _serve(self) -> None:
        while True:
            await self._wake.wait()
            if self.window_s:
                await asyncio.sleep(self.window_s)  # let episodes that start together join one batch
            self._wake.clear()
            while self._queue:
                await self._run(self._take())

    def _take(self) -> list[_Call]:
        """The next batch: the oldest waiting call and every later one that can share its engine call."""
        self._queue = [c for c in self._queue if not c.future.done()]  # callers that gave up
        if not self._queue:
            return []
        first = self._queue[0]
        taken, size = [first], len(first.prompts)
        if first.params.seed is None:
            for call in self._queue[1:]:
                if call.params == first.params and size + len(call.prompts) <= self.max_prompts:
                    taken.append(call)
                    size += len(call.prompts)
        chosen = {id(c) for c in taken}
        self._queue = [c for c in self._queue if id(c) not in chosen]
        return taken

    async def _run(self, calls: list[_Call]) -> None:
        if not calls:
            return
        prompts = [p for c in calls for p in c.prompts]
        self.batches += 1
        try:
            gens = await self.inner.generate(prompts, calls[0].params)
        except Exception as e:
            if len(calls) == 1:
                _settle(calls[0], exception=e)
                return
            log.warning("%s: a merged batch of %d calls failed (%s); running them one by one",
                        self.model_id, len(calls), e)
            for call in calls:
                await self._run([call])
            return
        start = 0
        for call in calls:
            _settle(call, result=gens[start:start + len(call.prompts)])
            start += len(call.prompts)


def _settle(call: _Call, *, result: list[Generation] | None = None, exception: BaseException | None = None) -> None:
    if call.future.done():
        return
    if exception is not None:
        call.future.set_exception(exception)
    else:
        call.future.set_result(result)
