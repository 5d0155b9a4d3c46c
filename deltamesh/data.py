"""The data interface between rollout pools, the dataflow broker and trainers (the trainer owns it).

The trajectory record (`Trajectory`; `build_trajectories` is the one validation every entry point
shares) and the two binary layouts (a submission of trajectories and a training batch: safetensors
bytes with per-sample metadata as JSON in `__metadata__`, see docs/api/broker.md). Nothing is
pickled; arrays travel as little-endian raw tensors. The trainer's client of the broker, which
speaks these layouts, is `deltamesh.trainer.batch_client`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from deltamesh.peer_json import parse_json
from deltamesh.safetensors_bytes import DataFormatError, load_tensors, safetensors_buffer

TRAJECTORIES_FORMAT = "deltamesh.trajectories/1"
BATCH_FORMAT = "deltamesh.batch/1"
TRAJECTORIES_CONTENT_TYPE = "application/vnd.deltamesh.trajectories+safetensors"
BATCH_CONTENT_TYPE = "application/vnd.deltamesh.batch+safetensors"

MAX_ID_CHARS = 256
MAX_GROUP_SIZE = 4096


@dataclass
class Trajectory:
    """One sampled sequence: prompt and generated tokens, with everything a trainer needs.

    The four arrays have one entry per token. `loss_mask` is 1 on generated tokens (the ones trained
    on); `versions` holds the policy version that generated each of them (-1 is allowed elsewhere).
    `group_id` names the group of `group_size` samples of one prompt that advantages compare.
    `min_version`/`max_version` span the versions of generated tokens (computed when left at -1);
    staleness is measured from `min_version`.
    """

    id: str
    task_id: str
    group_id: str
    group_size: int
    model_id: str
    tokens: np.ndarray  # int32
    logprobs: np.ndarray  # float32, behaviour policy
    loss_mask: np.ndarray  # uint8, 0/1
    versions: np.ndarray  # int32
    reward: float
    pool: str = ""
    region: str = ""
    timings: dict[str, float] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    min_version: int = -1
    max_version: int = -1

    def __post_init__(self) -> None:
        if self.min_version < 0 or self.max_version < 0:
            generated = self.versions[self.loss_mask.astype(bool)]
            if generated.size:
                self.min_version, self.max_version = int(generated.min()), int(generated.max())

    def header(self) -> dict[str, Any]:
        """The JSON part of the record (everything but the token arrays)."""
        return {
            "id": self.id, "task_id": self.task_id, "group_id": self.group_id, "group_size": self.group_size,
            "model_id": self.model_id, "reward": self.reward, "pool": self.pool, "region": self.region,
            "timings": self.timings, "metadata": self.metadata,
        }


_HEADER_FIELDS = frozenset({"id", "task_id", "group_id", "group_size", "model_id", "reward", "pool", "region",
                            "timings", "metadata"})
ARRAY_FIELDS = ("tokens", "logprobs", "loss_mask", "versions")


def _text(meta: dict[str, Any], key: str, where: str, *, required: bool = True) -> str:
    value = meta.get(key, None if required else "")
    if type(value) is not str or (required and not value) or len(value) > MAX_ID_CHARS:
        raise DataFormatError(f"{where}: {key} must be a{' non-empty' if required else ''} string of at most "
                              f"{MAX_ID_CHARS} characters, got {value!r:.80}")
    return value


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_header(meta: Any, index: int) -> dict[str, Any]:
    """The checked, normalised header fields of trajectory number `index` of a submission."""
    if not isinstance(meta, dict):
        raise DataFormatError(f"trajectory {index}: must be an object, got {type(meta).__name__}")
    unknown = meta.keys() - _HEADER_FIELDS
    if unknown:
        raise DataFormatError(f"trajectory {index}: unknown fields {sorted(unknown)}")
    where = f"trajectory {meta.get('id', index)!r:.80}"
    out = {"id": _text(meta, "id", where), "task_id": _text(meta, "task_id", where),
           "group_id": _text(meta, "group_id", where), "model_id": _text(meta, "model_id", where),
           "pool": _text(meta, "pool", where, required=False), "region": _text(meta, "region", where, required=False)}
    group_size = meta.get("group_size")
    if type(group_size) is not int or not 1 <= group_size <= MAX_GROUP_SIZE:
        raise DataFormatError(f"{where}: group_size must be an integer in 1..{MAX_GROUP_SIZE}, got {group_size!r:.40}")
    reward = meta.get("reward")
    if not _number(reward):
        raise DataFormatError(f"{where}: reward must be a finite number, got {reward!r:.40}")
    timings = meta.get("timings", {})
    if not isinstance(timings, dict) or not all(_number(v) for v in timings.values()):
        raise DataFormatError(f"{where}: timings must be an object of finite numbers")
    metadata = meta.get("metadata", {})
    if not isinstance(metadata, dict):
        raise DataFormatError(f"{where}: metadata must be an object")
    out.update(group_size=group_size, reward=float(reward), metadata=metadata,
               timings={k: float(v) for k, v in timings.items()})
    return out


def build_trajectories(headers: list[Any], tokens: np.ndarray, logprobs: np.ndarray, loss_mask: np.ndarray,
                       versions: np.ndarray, offsets: np.ndarray, *, max_tokens: int) -> list[Trajectory]:
    """Check a whole submission (arrays concatenated, trajectory i at offsets[i]:offsets[i+1]) at once.

    The array checks run over the concatenation, not per trajectory, so that checking costs a few
    vectorised passes however many trajectories a submission holds. DataFormatError says what is wrong.
    """
    checked = [check_header(h, i) for i, h in enumerate(headers)]
    if len({h["id"] for h in checked}) != len(checked):
        raise DataFormatError("a submission lists the same trajectory id twice")
    starts = offsets[:-1]
    lengths = np.diff(offsets)

    def fail(bad_tokens: np.ndarray, what: str) -> None:
        first = int(np.searchsorted(offsets, int(np.argmax(bad_tokens)), side="right")) - 1
        raise DataFormatError(f"trajectory {checked[first]['id']!r}: {what}")

    if lengths.size and (lengths.min() < 1 or lengths.max() > max_tokens):
        i = int(np.argmax((lengths < 1) | (lengths > max_tokens)))
        raise DataFormatError(f"trajectory {checked[i]['id']!r}: has {int(lengths[i])} tokens; allowed 1..{max_tokens}")
    if tokens.size and tokens.min() < 0:
        fail(tokens < 0, "token ids must be >= 0")
    if not np.isfinite(logprobs).all():
        fail(~np.isfinite(logprobs), "logprobs must be finite")
    if loss_mask.size and loss_mask.max() > 1:
        fail(loss_mask > 1, "loss_mask must hold only 0 and 1")
    generated = loss_mask.view(np.bool_)
    if (generated & (versions < 0)).any():
        fail(generated & (versions < 0), "generated tokens need a policy version >= 0")
    if not len(checked):
        return []
    counts = np.add.reduceat(loss_mask, starts, dtype=np.int64)
    if (counts == 0).any():
        raise DataFormatError(f"trajectory {checked[int(np.argmin(counts))]['id']!r}: no generated token "
                              "(loss_mask is all 0)")
    vmin = np.minimum.reduceat(np.where(generated, versions, np.iinfo(np.int32).max), starts)
    vmax = np.maximum.reduceat(np.where(generated, versions, -1), starts)
    out = []
    for i, h in enumerate(checked):
        a, b = int(offsets[i]), int(offsets[i + 1])
        out.append(Trajectory(**h, tokens=tokens[a:b], logprobs=logprobs[a:b], loss_mask=loss_mask[a:b],
                              versions=versions[a:b], min_version=int(vmin[i]), max_version=int(vmax[i])))
    return out


_TRAJECTORY_DTYPES = {"tokens": "int32", "logprobs": "float32", "loss_mask": "uint8", "versions": "int32",
                      "offsets": "int64"}


def encode_trajectories(trajectories: Sequence[Trajectory]) -> bytes:
    """A submission in the binary layout: the arrays of all trajectories concatenated, split by `offsets`."""
    offsets = np.zeros(len(trajectories) + 1, dtype=np.int64)
    np.cumsum([len(t.tokens) for t in trajectories], out=offsets[1:])
    total = int(offsets[-1])
    meta = {"format": TRAJECTORIES_FORMAT, "trajectories": json.dumps([t.header() for t in trajectories])}
    buf, v = safetensors_buffer([("logprobs", "float32", (total,)), ("loss_mask", "uint8", (total,)),
                                 ("offsets", "int64", (len(offsets),)), ("tokens", "int32", (total,)),
                                 ("versions", "int32", (total,))], meta)
    v["offsets"][:] = offsets
    for t, a, b in zip(trajectories, offsets[:-1], offsets[1:]):
        v["tokens"][a:b], v["logprobs"][a:b], v["loss_mask"][a:b], v["versions"][a:b] = (
            t.tokens, t.logprobs, t.loss_mask, t.versions)
    return bytes(buf)


def decode_trajectories(data: bytes, *, max_trajectories: int, max_tokens: int) -> list[Trajectory]:
    """Parse and check a binary submission; raise DataFormatError with the reason if anything is off."""
    arrays, meta = load_tensors(data, _TRAJECTORY_DTYPES, TRAJECTORIES_FORMAT)
    try:
        headers = parse_json(meta.get("trajectories", ""))
    except ValueError as e:
        raise DataFormatError(f"__metadata__.trajectories is not JSON: {e}") from e
    if not isinstance(headers, list) or not 1 <= len(headers) <= max_trajectories:
        raise DataFormatError(f"__metadata__.trajectories must list 1..{max_trajectories} headers")
    offsets = arrays["offsets"]
    total = len(arrays["tokens"])
    if offsets.shape != (len(headers) + 1,) or offsets[0] != 0 or offsets[-1] != total or (np.diff(offsets) < 0).any():
        raise DataFormatError("offsets must run from 0 to the token count, one more entry than trajectories")
    if any(arrays[k].shape != (total,) for k in ARRAY_FIELDS):
        raise DataFormatError("tokens, logprobs, loss_mask and versions must be 1-D and of equal length")
    return build_trajectories(headers, *(arrays[k] for k in ARRAY_FIELDS), offsets, max_tokens=max_tokens)


@dataclass
class Batch:
    """A training batch as the trainer receives it: padded [N, T] arrays plus per-sample metadata.

    Samples of one group are contiguous; `group_index[i]` points into `groups`. `replay[i]` is 1 for
    samples drawn from the replay store. Padding is 0 (tokens, logprobs, loss_mask) and -1 (versions).
    """

    model_id: str
    batch_id: str
    version: int
    tokens: np.ndarray
    logprobs: np.ndarray
    loss_mask: np.ndarray
    versions: np.ndarray
    lengths: np.ndarray
    rewards: np.ndarray
    group_index: np.ndarray
    replay: np.ndarray
    groups: list[str]
    samples: list[dict[str, Any]]

    def __len__(self) -> int:
        return len(self.samples)

    def tensors(self) -> dict[str, Any]:
        """The arrays as torch tensors (sharing memory with the numpy arrays)."""
        import torch

        names = ("tokens", "logprobs", "loss_mask", "versions", "lengths", "rewards", "group_index", "replay")
        return {name: torch.from_numpy(getattr(self, name)) for name in names}


_BATCH_DTYPES = {"tokens": "int32", "logprobs": "float32", "loss_mask": "uint8", "versions": "int32",
                 "lengths": "int32", "rewards": "float32", "group_index": "int32", "replay": "uint8"}


def encode_batch(trajectories: Sequence[Trajectory], replay: Sequence[bool], *, model_id: str, batch_id: str,
                 version: int) -> bytes:
    """The batch layout: trajectories in order (groups contiguous), right-padded to the longest."""
    n = len(trajectories)
    width = max((len(t.tokens) for t in trajectories), default=0)
    groups: list[str] = []
    group_index = np.zeros(n, np.int32)
    samples = []
    for i, t in enumerate(trajectories):
        if not groups or groups[-1] != t.group_id:
            groups.append(t.group_id)
        group_index[i] = len(groups) - 1
        samples.append({**t.header(), "min_version": t.min_version, "max_version": t.max_version,
                        "replay": bool(replay[i])})
    meta = {"format": BATCH_FORMAT, "model_id": model_id, "batch_id": batch_id, "version": str(version),
            "groups": json.dumps(groups), "samples": json.dumps(samples)}
    buf, v = safetensors_buffer([
        ("group_index", "int32", (n,)), ("lengths", "int32", (n,)), ("logprobs", "float32", (n, width)),
        ("loss_mask", "uint8", (n, width)), ("replay", "uint8", (n,)), ("rewards", "float32", (n,)),
        ("tokens", "int32", (n, width)), ("versions", "int32", (n, width))], meta)
    v["group_index"][:] = group_index
    v["replay"][:] = [bool(r) for r in replay]
    v["versions"].fill(-1)  # padding; the other arrays pad with the zeros the buffer starts with
    for i, t in enumerate(trajectories):
        k = len(t.tokens)
        v["lengths"][i], v["rewards"][i] = k, t.reward
        v["tokens"][i, :k], v["logprobs"][i, :k], v["loss_mask"][i, :k], v["versions"][i, :k] = (
            t.tokens, t.logprobs, t.loss_mask, t.versions)
    return bytes(buf)


def decode_batch(data: bytes) -> Batch:
    """Parse batch bytes from the broker; DataFormatError if they do not follow the layout."""
    arrays, meta = load_tensors(data, _BATCH_DTYPES, BATCH_FORMAT)
    try:
        groups, samples, version = parse_json(meta["groups"]), parse_json(meta["samples"]), int(meta["version"])
        model_id, batch_id = meta["model_id"], meta["batch_id"]
    except (KeyError, ValueError) as e:
        raise DataFormatError(f"batch __metadata__ is incomplete: {e}") from e
    if len(samples) != len(arrays["tokens"]):
        raise DataFormatError("batch has a different number of samples and token rows")
    return Batch(model_id=model_id, batch_id=batch_id, version=version, groups=groups, samples=samples,
                 **{name: arrays[name] for name in _BATCH_DTYPES})
