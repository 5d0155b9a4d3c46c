"""Atomic trainer checkpoints: fp32 master weights, optimizer state, counters and RNG state.

A checkpoint is a directory `v<version, 10 digits>/` under the checkpoint root holding
`model.safetensors` (the full fp32 state, tied tensors once), `optimizer.safetensors` (every
optimizer state tensor under `state/<parameter name>/<key>`) and `meta.json` (format, version,
step, the optimizer's param groups by parameter name, non-tensor optimizer state, RNG states as
JSON/base64, the xxh3-128 of both tensor files, and the caller's `extra`). Nothing is pickled. It is
written to a hidden temporary directory, fsynced, then renamed into place, so a crash leaves either
the old set of checkpoints or the new one; only the newest `keep` are kept. Under FSDP every rank
calls save and load (the state is gathered to and scattered from rank 0); only rank 0 touches files.

Resuming restores the version counter with the weights, and the bf16 cast of restored master
weights is bit-identical to what was published at that version, so a restarted trainer continues
both its version sequence and the mesh's delta chain.
"""

from __future__ import annotations

import base64
import json
import logging
import mmap
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from deltamesh.delta import digest
from deltamesh.trainer.distributed import SINGLE, DistContext, barrier, broadcast_tensors, full_state_dict
from deltamesh.trainer.step import TrainState

log = logging.getLogger(__name__)

FORMAT = 1
MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
META_FILE = "meta.json"
_NAME = re.compile(r"^v(\d{10})$")


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete, corrupt or of an unknown format."""


def checkpoint_name(version: int) -> str:
    return f"v{version:010d}"


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest version first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if _NAME.match(p.name) and (p / META_FILE).is_file()]
    return sorted(found, key=lambda p: p.name)


def latest_checkpoint(root: str | Path) -> Path | None:
    found = list_checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(
    root: str | Path,
    state: TrainState,
    ctx: DistContext = SINGLE,
    *,
    keep: int = 2,
    extra: dict[str, Any] | None = None,
) -> Path | None:
    """Checkpoint `state` as `root/v<version>`; every rank calls it, rank 0 writes and gets the path."""
    model_sd = full_state_dict(state.model, ctx)
    if state.optimizer.state:
        optim_sd = get_optimizer_state_dict(
            state.model, state.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
    else:
        # Before the first step. (Asking torch for the state dict now would initialise it with a
        # zero-gradient step, which counts as a step in Adam's bias correction.)
        optim_sd = {"state": {}, "param_groups": _named_param_groups(state)}
    path = None
    if ctx.is_main:
        assert model_sd is not None
        path = _write(Path(root), state, model_sd, optim_sd, keep, extra or {})
        log.info("checkpointed version %d (step %d) to %s", state.version, state.step, path)
    barrier(ctx)
    return path


def load_checkpoint(path: str | Path, state: TrainState, ctx: DistContext = SINGLE) -> dict[str, Any]:
    """Restore `state` (weights, optimizer, counters, RNG) from the checkpoint directory `path`.

    Every rank calls it; rank 0 reads and verifies the files and the state reaches the other ranks
    through the process group. Returns the checkpoint's metadata (its `extra` included). Raises
    CheckpointError, on every rank, if the checkpoint is unusable.
    """
    path = Path(path)
    model = state.model
    meta, model_sd, optim_sd, problem = {}, {}, {}, ""
    if ctx.is_main:
        try:
            meta, model_sd, optim_sd = _read(path)
            _check_fit(path, model, model_sd)
        except CheckpointError as e:
            problem = str(e)
    meta = _share_meta(meta, problem, ctx)
    if ctx.is_main:
        # Tied tensors are stored once; the model's state dict wants them under every name.
        first: dict[int, str] = {}
        for name, t in model.state_dict(keep_vars=True).items():
            first.setdefault(id(t), name)
            if name not in model_sd:
                model_sd[name] = model_sd[first[id(t)]]
    options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=ctx.distributed)
    set_model_state_dict(model, model_sd, options=options)
    if meta["optimizer_empty"]:
        state.optimizer.state.clear()
    else:
        set_optimizer_state_dict(model, state.optimizer, optim_sd, options=options)
    state.version = int(meta["version"])
    state.step = int(meta["step"])
    _set_rng(meta["rng"])
    log.info("resumed version %d (step %d) from %s", state.version, state.step, path)
    return meta


def resume_latest(root: str | Path, state: TrainState, ctx: DistContext = SINGLE) -> dict[str, Any] | None:
    """Load the newest checkpoint under `root` into `state`; None (state untouched) if there is none.

    Rank 0 looks; the answer reaches every rank.
    """
    found = torch.tensor([0], dtype=torch.int64)
    latest = latest_checkpoint(root) if ctx.is_main else None
    if latest is not None:
        found[0] = int(_NAME.match(latest.name).group(1)) + 1  # type: ignore[union-attr]
    found = broadcast_tensors({"found": found}, {"found": torch.int64}, ctx)["found"]
    assert found is not None
    if int(found[0]) == 0:
        return None
    return load_checkpoint(Path(root) / checkpoint_name(int(found[0]) - 1), state, ctx)


def _write(
    root: Path,
    state: TrainState,
    model_sd: dict[str, torch.Tensor],
    optim_sd: dict[str, Any],
    keep: int,
    extra: dict[str, Any],
) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    name = checkpoint_name(state.version)
    tmp = root / f".tmp-{name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    tensors, scalars = _flatten_optimizer_state(optim_sd["state"])
    save_file({k: v.contiguous() for k, v in model_sd.items()}, tmp / MODEL_FILE)
    save_file(tensors, tmp / OPTIMIZER_FILE)
    meta = {
        "format": FORMAT,
        "version": state.version,
        "step": state.step,
        "param_groups": [_json_group(g) for g in optim_sd["param_groups"]],
        "optimizer_scalars": scalars,
        "optimizer_empty": not optim_sd["state"],
        "rng": _get_rng(),
        "files": {f: _file_digest(tmp / f) for f in (MODEL_FILE, OPTIMIZER_FILE)},
        "extra": extra,
    }
    (tmp / META_FILE).write_text(json.dumps(meta, indent=1))
    for f in (MODEL_FILE, OPTIMIZER_FILE, META_FILE):
        _fsync(tmp / f)
    _fsync(tmp)
    final = root / name
    if final.exists():
        # Re-checkpointing a version (after a restart): move the old one aside, never half-replace.
        old = root / f".old-{name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync(root)
    for stale in list_checkpoints(root)[:-keep]:
        shutil.rmtree(stale, ignore_errors=True)
    for leftover in root.glob(".tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    return final


def _read(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor], dict[str, Any]]:
    try:
        meta = json.loads((path / META_FILE).read_text())
    except FileNotFoundError as e:
        raise CheckpointError(f"{path} is not a checkpoint (no {META_FILE})") from e
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}/{META_FILE} is unreadable: {e}") from e
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{path}: unknown checkpoint format {meta.get('format') if isinstance(meta, dict) else meta!r}")
    for key in ("version", "step", "param_groups", "optimizer_scalars", "optimizer_empty", "rng", "files"):
        if key not in meta:
            raise CheckpointError(f"{path}/{META_FILE} lacks {key!r}")
    for f in (MODEL_FILE, OPTIMIZER_FILE):
        try:
            actual = _file_digest(path / f)
        except OSError as e:
            raise CheckpointError(f"{path}/{f} is unreadable: {e}") from e
        if actual != meta["files"].get(f):
            raise CheckpointError(f"{path}/{f} is corrupt (xxh3 {actual}, expected {meta['files'].get(f)})")
    try:
        model_sd = load_file(path / MODEL_FILE)
        optim_tensors = load_file(path / OPTIMIZER_FILE)
    except (OSError, SafetensorError) as e:
        raise CheckpointError(f"{path}: cannot read tensors: {e}") from e
    optim_sd = {
        "state": _unflatten_optimizer_state(optim_tensors, meta["optimizer_scalars"]),
        "param_groups": [_group_from_json(g) for g in meta["param_groups"]],
    }
    return meta, model_sd, optim_sd


def _check_fit(path: Path, model: torch.nn.Module, model_sd: dict[str, torch.Tensor]) -> None:
    """Refuse, before any rank changes anything, a checkpoint of another architecture."""
    expected: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    seen: set[int] = set()
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            expected[name] = (tuple(t.shape), t.dtype)  # a sharded tensor reports its full shape
    found = {name: (tuple(t.shape), t.dtype) for name, t in model_sd.items()}
    if found != expected:
        missing = sorted(set(expected) - set(found))
        unexpected = sorted(set(found) - set(expected))
        differing = sorted(n for n in set(found) & set(expected) if found[n] != expected[n])
        raise CheckpointError(
            f"{path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"different shape or dtype {differing[:5]}"
        )


def _share_meta(meta: dict[str, Any], problem: str, ctx: DistContext) -> dict[str, Any]:
    """Rank 0's metadata (or its error) on every rank, as JSON bytes."""
    payload = json.dumps({"meta": meta, "problem": problem}).encode()
    sent = broadcast_tensors(
        {"json": torch.frombuffer(bytearray(payload), dtype=torch.uint8)} if ctx.is_main else None,
        {"json": torch.uint8},
        ctx,
    )["json"]
    assert sent is not None
    shared = json.loads(bytes(sent.tolist()).decode())
    if shared["problem"]:
        raise CheckpointError(shared["problem"])
    return shared["meta"]


def _flatten_optimizer_state(state: dict[str, dict[str, Any]]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param, entries in state.items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state/{param}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(param, {})[key] = value
    return tensors, scalars


def _unflatten_optimizer_state(
    tensors: dict[str, torch.Tensor], scalars: dict[str, Any]
) -> dict[str, dict[str, Any]]:
    state: dict[str, dict[str, Any]] = {p: dict(v) for p, v in scalars.items()}
    for flat, value in tensors.items():
        prefix, rest = flat.split("/", 1)
        param, key = rest.rsplit("/", 1)
        if prefix != "state":
            raise CheckpointError(f"unexpected tensor {flat!r} in {OPTIMIZER_FILE}")
        state.setdefault(param, {})[key] = value
    return state


def _named_param_groups(state: TrainState) -> list[dict[str, Any]]:
    names = {id(p): n for n, p in state.model.named_parameters()}
    return [{**g, "params": [names[id(p)] for p in g["params"]]} for g in state.optimizer.param_groups]


def _json_group(group: dict[str, Any]) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in group.items()}


def _group_from_json(group: dict[str, Any]) -> dict[str, Any]:
    # JSON has no tuples; optimizer hyperparameters such as betas are tuples.
    return {k: tuple(v) if isinstance(v, list) and k != "params" else v for k, v in group.items()}


def _get_rng() -> dict[str, Any]:
    np_state = np.random.get_state()
    py_state = random.getstate()
    rng = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "python": [py_state[0], list(py_state[1]), py_state[2]],
    }
    if torch.cuda.is_available():
        rng["cuda"] = [base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()]
    return rng


def _set_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(torch.frombuffer(bytearray(base64.b64decode(rng["torch"])), dtype=torch.uint8))
    kind, keys, pos, has_gauss, cached = rng["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    version, internal, gauss_next = rng["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in rng and torch.cuda.is_available():
        states = [torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8) for s in rng["cuda"]]
        torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])


def _file_digest(path: Path) -> str:
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return digest(b"")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m, memoryview(m) as view:
            return digest(view)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
