"""The JSON form of a trajectory submission, for clients that cannot build the binary layout.

`{"trajectories": [{<header fields>, "tokens": [...], "logprobs": [...], "loss_mask": [...],
"versions": [...]}]}`: the same fields as the binary layout of `deltamesh.data`, arrays as
JSON lists. The lists are typed and range-checked here, then checked as a whole submission by the
same `build_trajectories` the binary form goes through.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from deltamesh.data import ARRAY_FIELDS, DataFormatError, Trajectory, build_trajectories


def _json_array(item: dict[str, Any], key: str, dtype: type, kinds: str, index: int) -> np.ndarray:
    values = item.get(key)
    where = f"trajectory {item.get('id', index)!r:.80}"
    if not isinstance(values, list):
        raise DataFormatError(f"{where}: {key} must be a list of numbers")
    try:
        arr = np.asarray(values)
    except ValueError as e:
        raise DataFormatError(f"{where}: {key}: {e}") from e
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in kinds):
        raise DataFormatError(f"{where}: {key} must be a flat list of {'numbers' if 'f' in kinds else 'integers'}")
    if arr.dtype.kind in "iu" and arr.size and (arr.min() < np.iinfo(dtype).min or arr.max() > np.iinfo(dtype).max):
        raise DataFormatError(f"{where}: {key} holds values outside {np.dtype(dtype).name}")
    return arr.astype(dtype)


def trajectories_from_json(body: Any, *, max_trajectories: int, max_tokens: int) -> list[Trajectory]:
    """The JSON form of a submission: `{"trajectories": [{..header.., "tokens": [...], ...}]}`."""
    items = body.get("trajectories") if isinstance(body, dict) else None
    if not isinstance(items, list) or not 1 <= len(items) <= max_trajectories:
        raise DataFormatError(f"body must be {{\"trajectories\": [1..{max_trajectories} objects]}}")
    arrays: dict[str, list[np.ndarray]] = {k: [] for k in ARRAY_FIELDS}
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise DataFormatError(f"trajectory {i}: must be an object")
        for key, dtype, kinds in (("tokens", np.int32, "iu"), ("logprobs", np.float32, "iuf"),
                                  ("loss_mask", np.uint8, "iub"), ("versions", np.int32, "iu")):
            arrays[key].append(_json_array(item, key, dtype, kinds, i))
        if len({len(arrays[k][-1]) for k in ARRAY_FIELDS}) != 1:
            raise DataFormatError(f"trajectory {item.get('id', i)!r:.80}: tokens, logprobs, loss_mask and versions "
                                  "differ in length")
    offsets = np.zeros(len(items) + 1, np.int64)
    np.cumsum([len(a) for a in arrays["tokens"]], out=offsets[1:])
    headers = [{k: v for k, v in item.items() if k not in ARRAY_FIELDS} for item in items]
    return build_trajectories(headers, *(np.concatenate(arrays[k]) for k in ARRAY_FIELDS), offsets,
                              max_tokens=max_tokens)
