"""Decoding JSON that a peer sent, within limits: malformed or hostile input is a ValueError, never a crash.

Python's decoder recurses once per level of nesting, so a body of a few kilobytes of `[[[[...` ends in
RecursionError, which servers would turn into a 500. Every place that decodes peer-sent JSON (request
bodies, safetensors headers of submissions and batches, manifest envelopes) goes through `parse_json`.
"""

from __future__ import annotations

import json
from typing import Any

MAX_JSON_DEPTH = 64
"""Deepest nesting of arrays and objects accepted (no deltamesh message nests more than a few levels)."""


def parse_json(raw: bytes | str, *, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Decode JSON a peer sent; ValueError (never RecursionError) if malformed or nested deeper than
    `max_depth` arrays and objects: no deltamesh message nests deeper, and a deep one is an attack."""
    try:
        value = json.loads(raw)
    except RecursionError:
        raise ValueError(f"JSON nested deeper than {max_depth} levels") from None
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            if depth > max_depth:
                raise ValueError(f"JSON nested deeper than {max_depth} levels")
            stack.extend((v, depth + 1) for v in (item.values() if isinstance(item, dict) else item))
    return value
