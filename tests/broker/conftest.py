"""Fixtures of the broker tests: the durable store under test, on each backend in turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from deltamesh.mesh.broker.backends import open_store
from deltamesh.mesh.broker.store_interface import BrokerStore


@pytest.fixture(params=["sqlite", "postgres"])
def store_factory(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., BrokerStore]]:
    """`open()` opens the store under test: an SQLite file, or a PostgreSQL database of the test's own.
    Every call opens the same one again (close the last one first: SQLite allows one broker per file);
    `open(term=...)` passes a leadership term. Every store opened is closed at the end."""
    db = request.getfixturevalue("postgres_dsn") if request.param == "postgres" else str(tmp_path / "broker.db")
    opened: list[BrokerStore] = []

    def open_(**kw: Any) -> BrokerStore:
        opened.append(open_store(db, durability="fsync", **kw))
        return opened[-1]

    yield open_
    for store in opened:
        store.close()
