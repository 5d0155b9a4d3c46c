"""The evaluator's results: one row per scored version of a policy, in an SQLite file of its own.

A result is the version, the weights hash the engine proved it served when the version was scored
(the check after the swap read the engine's weights back against the trainer's signed hashes), the
held-out set's digest, avg@n and its parts, and when it was scored. Only the evaluator writes the
file; rows go in once (a version is never scored twice under one set) and survive restarts, so a
restarted evaluator carries on after the versions it has. Rows are JSON this process wrote, read back
with `json`.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS evals (
    model_id TEXT NOT NULL,
    heldout TEXT NOT NULL,
    version INTEGER NOT NULL,
    weights_hash TEXT NOT NULL,
    accuracy REAL NOT NULL,
    record TEXT NOT NULL,
    PRIMARY KEY (model_id, heldout, version)
)
"""


@dataclass
class EvalResult:
    """One scored version."""

    model_id: str
    version: int
    weights_hash: str
    """The hash of the weights the engine served, as proven by the check after the swap."""
    heldout: str
    """The held-out set's digest (`heldout.set_digest`)."""
    accuracy: float
    """avg@samples over the set."""
    samples: int
    """Samples per problem (n)."""
    problems: int
    correct: int
    failed: int = 0
    by_level: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    """Wall time of the scoring."""
    scored_at: float = 0.0
    """Wall-clock time (time.time) the score was stored."""
    check: str = ""
    """The check that proved what the engine served."""
    reason: str = "every"
    """Why it was scored: every (the k-th version), request (asked for), or initial (version 0)."""

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


class EvalStore:
    """Results in SQLite (WAL). Calls are short and serialized by a lock; safe from any thread."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(SCHEMA)
        self._lock = threading.Lock()

    def add(self, result: EvalResult) -> bool:
        """Store `result`; False (nothing changed) if that version of that set is already scored."""
        with self._lock:
            cur = self._db.execute(
                "INSERT OR IGNORE INTO evals (model_id, heldout, version, weights_hash, accuracy, record) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                (result.model_id, result.heldout, result.version, result.weights_hash, result.accuracy,
                 json.dumps(result.as_json())))
            return cur.rowcount == 1

    def results(self, model_id: str, heldout: str | None = None) -> list[EvalResult]:
        """The scored versions of `model_id` (of one set, or of every set), oldest version first."""
        query = "SELECT record FROM evals WHERE model_id = ?"
        args: tuple[Any, ...] = (model_id,)
        if heldout is not None:
            query, args = query + " AND heldout = ?", (*args, heldout)
        with self._lock:
            rows = self._db.execute(query + " ORDER BY version", args).fetchall()
        return [EvalResult(**json.loads(r[0])) for r in rows]

    def versions(self, model_id: str, heldout: str) -> set[int]:
        with self._lock:
            rows = self._db.execute("SELECT version FROM evals WHERE model_id = ? AND heldout = ?",
                                    (model_id, heldout)).fetchall()
        return {int(r[0]) for r in rows}

    def close(self) -> None:
        with self._lock:
            self._db.close()
