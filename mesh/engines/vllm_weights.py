"""Writing weights into a live in-process vLLM engine through vLLM's own in-place reload API.

vLLM keeps weights in its kernel format (q/k/v fused into one `qkv_proj`, gate/up into
`gate_up_proj`, repacked for some hardware), so nothing here writes a parameter directly: every
update goes through the worker's `reload_weights(weights_iterator=..., is_checkpoint_format=True)`
(`vllm.model_executor.model_loader.reload.inplace`). It runs the model's own `load_weights` and
post-processing layer by layer and copies each result into the existing storage, so the tensors
handed over are checkpoint tensors (names and layout as in the model directory).

vLLM processes a layer once every checkpoint tensor that feeds it has arrived; a layer handed part
of its inputs (only `q_proj` of a `qkv_proj`, or a weight without its bias) is materialised with the
rest uninitialised (seen here: k and v became garbage when only q was reloaded). So an update that
touches some tensors hands over every tensor of each layer it touches (`layer_groups`, through the
model's `packed_modules_mapping`), and vLLM re-processes only those layers: its time is the floor
of an in-place update.

Reading back (`digests`): where vLLM keeps a layer's weights as plain parameters (CUDA, and the CPU
build when it falls back to torch's linear, as here), a fused parameter is the concatenation along
dim 0 of its checkpoint parts in `packed_modules_mapping` order (q, k, v; gate, up), each a bit-exact
copy for bf16 without quantization, so every checkpoint tensor is a row slice of one vLLM parameter
and hashes like the checkpoint tensor. A parameter vLLM emptied after repacking it into an opaque
kernel format (oneDNN/AMX on some CPUs) cannot be read back; those tensors are reported unreadable.

The engine core must run in this process (`multiprocess_mode=False`): the tensors go to the worker
by reference, not serialised through a socket. A reload that fails half way leaves layers buffered
on the meta device; `restore` finishes vLLM's reload state first, then writes the previous tensors
of the same layers back.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import defaultdict
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch

from deltamesh.delta import Grid, tensor_digest

# vLLM's reload warns once per layer it was not handed anything for, and lists those weights: on a
# partial update that is every untouched layer, by design, so those two loggers are quieted then.
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")


class Fusion:
    """How vLLM fuses checkpoint modules into one of its layers (the model's `packed_modules_mapping`:
    q/k/v -> qkv_proj, gate/up -> gate_up_proj), for a whole model or a rank's share of it alike."""

    def __init__(self, packed: Mapping[str, Iterable[str]]) -> None:
        self.parts = {fused: list(parts) for fused, parts in packed.items()}
        # checkpoint module name -> the fused vLLM module it loads into (q_proj -> qkv_proj, ...)
        self.fused_into = {part: fused for fused, parts in self.parts.items() for part in parts}

    def layer_of(self, name: str) -> str:
        """The vLLM module checkpoint tensor `name` loads into."""
        module, _, _param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        fused = self.fused_into.get(leaf)
        return f"{parent}.{fused}" if fused else module

    def group(self, names: Iterable[str]) -> dict[str, list[str]]:
        """The checkpoint tensors `names` by the vLLM module each loads into."""
        groups: dict[str, list[str]] = defaultdict(list)
        for name in names:
            groups[self.layer_of(name)].append(name)
        return dict(groups)

    def layer_groups(self, changed: Iterable[str], groups: Mapping[str, list[str]]) -> list[str]:
        """Every checkpoint tensor (of `groups`, see `group`) of each layer that one of `changed` feeds."""
        layers = {self.layer_of(name) for name in changed}
        return [name for layer in sorted(layers) for name in groups.get(layer, [layer])]

    def place(self, name: str, shapes: Mapping[str, Sequence[int]]) -> tuple[str, int] | None:
        """(vLLM parameter name, first row) of checkpoint tensor `name` in its fused parameter, where the
        parts before it have the row counts of `shapes` (whole tensors, or what a rank holds of them);
        None when a part before it is missing from `shapes`."""
        module, _, param = name.rpartition(".")
        parent, _, leaf = module.rpartition(".")
        fused = self.fused_into.get(leaf)
        if fused is None:
            return name, 0
        offset = 0
        for part in self.parts[fused]:
            if part == leaf:
                return f"{parent}.{fused}.{param}", offset
            sibling = shapes.get(f"{parent}.{part}.{param}")
            if sibling is None:
                return None
            offset += sibling[0]
        return None


class VLLMWeights:
    """The weights side of one in-process `vllm.v1.engine.llm_engine.LLMEngine`. Callers make sure
    no engine step runs meanwhile."""

    def __init__(self, engine: Any, names: Iterable[str]) -> None:
        self._engine = engine
        (packed,) = engine.apply_model(lambda model: dict(getattr(model, "packed_modules_mapping", {}) or {}))
        self._fusion = Fusion(packed)
        self._groups = self._fusion.group(names)
        self.last_reload_s = 0.0
        """Seconds the last reload spent inside vLLM (its re-processing: the floor of an update)."""

    def layer_groups(self, changed: Iterable[str]) -> list[str]:
        """Every checkpoint tensor of each layer that one of `changed` feeds, in checkpoint order."""
        return self._fusion.layer_groups(changed, self._groups)

    def load(self, tensors: Mapping[str, torch.Tensor], names: list[str]) -> None:
        """Hand vLLM `tensors[name]` for `names` (whole layers, see `layer_groups`); vLLM reprocesses
        those layers and leaves the others as they are."""
        partial = len(names) < sum(len(g) for g in self._groups.values())
        with quiet_partial_reload(partial):
            self._reload(weights_iterator=((name, tensors[name]) for name in names))

    def load_dir(self, path: str) -> None:
        """vLLM reads the checkpoint in directory `path` itself and reprocesses every layer."""
        self._reload(weights_path=path)

    def restore(self, tensors: Mapping[str, torch.Tensor], names: list[str]) -> None:
        """After a failed `load`/`load_dir`: finish whatever reload state vLLM was left in, then load
        `tensors` for `names` (what those layers held before)."""
        self._finish_reload()
        self.load(tensors, names)

    def digests(self, names: Iterable[str], checkpoint: Mapping[str, torch.Tensor],
                grids: Mapping[str, Grid] | None = None) -> dict[str, str | None]:
        """xxh3-128 of each checkpoint tensor of `names` as vLLM's forward pass reads it (None where it
        cannot be read back), found as a row slice of vLLM's parameter; `checkpoint` gives the shapes
        and dtypes of every checkpoint tensor (the host copy), which place the parts of fused ones; a
        tensor with a hash grid in `grids` is hashed by its tiles."""
        where = {name: self._slice_of(name, checkpoint) for name in names}
        (found,) = self._engine.apply_model(lambda model: _read_back(model, where, grids or {}))
        return found

    def _slice_of(self, name: str, checkpoint: Mapping[str, torch.Tensor]) -> tuple[str, int, torch.Tensor] | None:
        """(vLLM parameter name, first row, the checkpoint tensor) of checkpoint tensor `name`."""
        if name not in checkpoint:
            return None
        place = self._fusion.place(name, {n: t.shape for n, t in checkpoint.items()})
        return None if place is None else (*place, checkpoint[name])

    def _reload(self, **source: Any) -> None:
        started = time.perf_counter()
        self._reload_in_worker(source)
        self.last_reload_s = time.perf_counter() - started

    # The two calls into vLLM's worker; a weight-transfer backend, which runs inside the worker, makes
    # them on its model directly instead (deltamesh.mesh.vllm_plugin.worker_weights).
    def _reload_in_worker(self, source: dict[str, Any]) -> None:
        """vLLM's in-place reload in checkpoint format, from `source` (an iterator or a directory)."""
        self._engine.collective_rpc("reload_weights", kwargs={**source, "is_checkpoint_format": True})

    def _finish_reload(self) -> None:
        """End a reload that raised half way (see `finish_reload`)."""
        self._engine.collective_rpc(_finish_reload)


def _read_back(model: torch.nn.Module, where: Mapping[str, tuple[str, int, torch.Tensor] | None],
               grids: Mapping[str, Grid]) -> dict[str, str | None]:
    """Runs in the worker: hash rows [first, first + rows) of each vLLM parameter, where its shape and
    dtype show it holds the checkpoint tensor's words as they are (else None: unreadable)."""
    params = dict(model.named_parameters())
    found: dict[str, str | None] = {}
    for name, spot in where.items():
        found[name] = None
        if spot is None:
            continue
        param_name, first, ref = spot
        rows = param_rows(params, param_name, first, tuple(ref.shape), ref.dtype)
        if rows is not None:
            found[name] = tensor_digest(rows, grids.get(name))
    return found


def param_rows(params: Mapping[str, torch.Tensor], param_name: str, first: int, shape: tuple[int, ...],
               dtype: torch.dtype) -> torch.Tensor | None:
    """Rows [first, first + shape[0]) of vLLM parameter `param_name` (all of a 0-d one), where its dtype
    and shape show it holds a checkpoint tensor (or a rank's share of one) of `shape` as it is: a plain
    parameter, or a fused one whose parts are stacked along dim 0, or with vocabulary padding rows
    after; else None (a parameter repacked into a kernel format cannot be read back)."""
    p = params.get(param_name)
    if p is None or p.dtype != dtype or p.dim() != len(shape) or tuple(p.shape[1:]) != tuple(shape[1:]):
        return None
    if p.dim() == 0:
        return p.data if tuple(p.shape) == shape else None
    return p.data[first:first + shape[0]] if p.shape[0] >= first + shape[0] else None


def _finish_reload(worker: Any) -> None:
    """Runs in the worker: `finish_reload` on its model."""
    runner = worker.model_runner
    finish_reload(runner.get_model(), runner.model_config)


def finish_reload(model: torch.nn.Module, model_config: Any) -> None:
    """End a reload that raised half way (layers left on the meta device with wrapped loaders), as
    vLLM's own reload ends one."""
    from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

    finalize_layerwise_reload(model, model_config)


@contextlib.contextmanager
def quiet_partial_reload(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    below_error = _BelowError()
    loggers = [logging.getLogger(name) for name in _RELOAD_LOGGERS]
    for logger in loggers:
        logger.addFilter(below_error)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(below_error)


class _BelowError(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.ERROR
