"""The end of a soak: gather the history the final checks need from where it was written down.

The pools' ledgers (every submission the broker acknowledged to them), the broker's database on the
PostgreSQL primary of the moment (each stored trajectory with its group's state, each acknowledged
batch with its version and its oldest sample's version), each pool's synced directory (the version
it holds, the hash its manifest claims and the hash of the weights its files hold), and the process
and store readings cut into process lives for the leak slopes. Nothing here judges: soak_checks.py does.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from soak_mesh import MODEL, SoakMesh
from soak_observe import Readings

STORED = """SELECT t.id, COALESCE(g.state, 'none') FROM broker_trajectories t
            LEFT JOIN broker_groups g ON g.model_id = t.model_id AND g.group_id = t.group_id"""
ACKED_BATCHES = """SELECT b.batch_id, b.version, MIN(g.min_version) FROM broker_batches b
                   JOIN broker_groups g ON g.batch_no = b.batch_no
                   WHERE b.state = 'acked' GROUP BY b.batch_id, b.version"""


def ledgers(mesh: SoakMesh) -> dict[str, set[str]]:
    """Pool -> the trajectory ids its ledger says the broker acknowledged (a torn last line is skipped)."""
    out: dict[str, set[str]] = {}
    for pool in mesh.pools:
        ids: set[str] = set()
        try:
            lines = mesh.ledger(pool).read_text().splitlines()
        except FileNotFoundError:
            lines = []
        for line in lines:
            try:
                ids.update(json.loads(line)["ids"])
            except (ValueError, KeyError):
                continue
        out[pool] = ids
    return out


def database(dsn: str) -> tuple[dict[str, str], list[tuple[str, int, int]]]:
    """(trajectory id -> its group's state, [(batch id, version, oldest sample version)] acknowledged)."""
    import psycopg

    with psycopg.connect(dsn) as conn:
        stored = dict(conn.execute(STORED).fetchall())
        batches = [(b, int(v), int(o)) for b, v, o in conn.execute(ACKED_BATCHES).fetchall()]
    return stored, batches


def pool_dir(path: Path) -> dict[str, Any]:
    """The version a pool's directory holds, the hash its manifest claims and the hash of its files."""
    from deltamesh.delta import dir_manifest, read_weights, weights_hash

    try:
        manifest = dir_manifest(path)
        if manifest is None:
            return {"error": f"{path} holds no version"}
        return {"version": manifest.version, "manifest_hash": manifest.weights_hash,
                "files_hash": weights_hash(read_weights(path))}
    except Exception as e:  # noqa: BLE001 - a broken directory is a finding, not a crash of the audit
        return {"error": f"{type(e).__name__}: {e}"}


def pool_dirs(mesh: SoakMesh) -> dict[str, dict[str, Any]]:
    return {pool: pool_dir(mesh.pool_dir(pool) / MODEL) for pool in mesh.pools}


def lives(readings: Readings) -> dict[str, dict[str, list[list[tuple[float, float]]]]]:
    """Process or store -> measure -> one (t, value) series per process life (a new pid starts one)."""
    out: dict[str, dict[str, list[list[tuple[float, float]]]]] = {}
    for name, samples in readings.procs.items():
        measures: dict[str, list[list[tuple[float, float]]]] = {"fds": [], "threads": [], "rss_mib": [],
                                                                 "connections": []}
        pid = None
        for s in samples:
            if s.pid != pid:
                pid = s.pid
                for series in measures.values():
                    series.append([])
            measures["fds"][-1].append((s.t, s.fds))
            measures["threads"][-1].append((s.t, s.threads))
            measures["rss_mib"][-1].append((s.t, s.rss_mib))
            measures["connections"][-1].append((s.t, s.connections))
        out[name] = measures
    for name, points in readings.disk.items():
        out.setdefault(name, {})["disk_mib"] = [list(points)]
    return out


def cpu_seconds(readings: Readings) -> dict[str, float]:
    """CPU seconds each process name used over all its lives (from the last sample of each life)."""
    total: dict[str, float] = {}
    for name, samples in readings.procs.items():
        last: dict[int, float] = {}
        for s in samples:
            last[s.pid] = s.cpu_s
        total[name] = round(sum(last.values()), 1)
    return total
