"""Peer-sent JSON within limits: deep nesting is a ValueError at any depth, never a RecursionError."""

from __future__ import annotations

import pytest

from deltamesh.peer_json import MAX_JSON_DEPTH, parse_json


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_nesting_up_to_the_limit_is_accepted():
    assert parse_json(nested(MAX_JSON_DEPTH)) is not None
    assert parse_json('{"a": {"b": [1, {"c": null}]}}') == {"a": {"b": [1, {"c": None}]}}


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 5_000, 1_000_000])
def test_deeper_nesting_is_refused(depth):
    with pytest.raises(ValueError, match=f"nested deeper than {MAX_JSON_DEPTH}"):
        parse_json(nested(depth))


def test_malformed_json_is_a_value_error():
    with pytest.raises(ValueError):
        parse_json(b"{not json")
