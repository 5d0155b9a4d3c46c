"""The trainer's per-step record: one log line and one JSON line (in `--metrics-file`) per version.

A step's record is complete only when its version's publish has ended, which happens in the
background while the next batch is polled, so `StepLog` pairs each record with its publish outcome
and writes it the moment both are in. The fields are what the demo and the end-to-end benchmark read:
step, version, the ids of the trajectories trained on, reward mean, the loss terms, how many samples
came from each rollout pool, and where the step's time went (waiting for the batch, training, stalled
on the previous publish: its encode with `encode_first`, its end when a new one starts; the publish
itself) with the wait fraction, and
each pool's trainer-side mismatch on the tokens of the version trained on (`mismatch`: {"version",
"pools": {pool: {"tokens", "abs", "k3", "flagged", "reason"}}}), and the wall-clock times
(`time.time()` on the trainer's host) at which the version passed each stage of its publish
(`stages`: step_end, cast, encoded, signed, upload_start, uploaded; the trainer's part of the
latency budget that `benchmarks/latency.py` follows through gateways and pools).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from deltamesh.data import Batch
from deltamesh.trainer.mesh_client import PublishOutcome
from deltamesh.trainer.mismatch import PoolMismatch

log = logging.getLogger(__name__)

LOSS_TERMS = ("loss", "pg_loss", "kl", "m2", "m2po_masked_frac", "clip_frac", "ratio_mean", "grad_norm", "lr", "tokens",
              "updated")


def step_record(*, step: int, version: int, batch: Batch, metrics: dict[str, float], trained_on: int,
                wait_s: float, train_s: float, stall_s: float, step_s: float,
                mismatch: dict[str, PoolMismatch] | None = None) -> dict[str, Any]:
    """The record of one step before its publish ends; `trained_on` is the version the batch trained,
    `mismatch` the pools' mismatch on its tokens (`MismatchWatch.observe`)."""
    lags = [trained_on - int(s.get("min_version", trained_on)) for s in batch.samples]
    return {
        "time": time.time(), "step": step, "version": version, "batch_id": batch.batch_id,
        "samples": len(batch), "ids": [str(s.get("id", "")) for s in batch.samples],
        "reward_mean": float(batch.rewards.mean()) if len(batch) else 0.0,
        **{k: metrics[k] for k in LOSS_TERMS},
        "staleness_mean": sum(lags) / len(lags) if lags else 0.0, "staleness_max": max(lags, default=0),
        "pools": dict(Counter(str(s.get("pool", "")) for s in batch.samples)),
        "wait_seconds": wait_s, "train_seconds": train_s, "publish_stall_seconds": stall_s,
        "step_seconds": step_s, "wait_fraction": wait_s / step_s if step_s > 0 else 0.0,
        "mismatch": {"version": trained_on, "pools": {p: r.record() for p, r in (mismatch or {}).items()}},
    }


class StepLog:
    """Writes each step's record once both the step and its version's publish have ended.

    `add` (the training thread) and `published` (the thread that ran the publish) may come in
    either order; records are written in version order as soon as both halves are in.
    """

    def __init__(self, metrics_file: str | Path | None):
        self.path = Path(metrics_file) if metrics_file else None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        self._records: dict[int, dict[str, Any]] = {}
        self._outcomes: dict[int, PublishOutcome] = {}
        self._lock = threading.Lock()

    def add(self, record: dict[str, Any]) -> None:
        with self._lock:
            self._records[record["version"]] = record
            self._write_ready()

    def published(self, outcome: PublishOutcome) -> None:
        with self._lock:
            self._outcomes[outcome.version] = outcome
            self._write_ready()

    def _write_ready(self) -> None:
        for version in sorted(self._records):
            outcome = self._outcomes.pop(version, None)
            if outcome is None:
                return
            record = self._records.pop(version)
            record.update(published=outcome.ok, publish_seconds=outcome.seconds, publish_bytes=outcome.bytes_sent,
                          publish_kinds=outcome.kinds, stages=dict(outcome.stages))
            self._write(record)

    def _write(self, r: dict[str, Any]) -> None:
        published = (f"publish {r['publish_seconds']:.2f} s ({'+'.join(r['publish_kinds'])} {r['publish_bytes']} B)"
                     if r.get("published") else "publish FAILED")
        log.info("step %d v%d: reward %.3f loss %.4g kl %.3g | wait %.2f s train %.2f s %s | wait fraction %.2f",
                 r["step"], r["version"], r["reward_mean"], r["loss"], r["kl"], r["wait_seconds"],
                 r["train_seconds"], published, r["wait_fraction"])
        if self.path is not None:
            with open(self.path, "a") as f:
                f.write(json.dumps(r) + "\n")
