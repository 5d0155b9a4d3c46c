"""The trainer's step log: a step's record is written once its version's publish has ended, in version
order, with the publish's outcome and its stage times (the trainer's part of the latency budget)."""

from __future__ import annotations

import json

from deltamesh.trainer.mesh_client import PublishOutcome
from deltamesh.trainer.step_log import StepLog


def _record(version: int) -> dict:
    return {"time": 100.0 + version, "step": version, "version": version, "reward_mean": 0.5, "loss": 0.1, "kl": 0.0,
            "wait_seconds": 0.1, "train_seconds": 0.2, "wait_fraction": 0.3}


def test_records_carry_the_publish_and_its_stages_in_version_order(tmp_path):
    path = tmp_path / "steps.jsonl"
    log = StepLog(path)
    stages = {"step_end": 100.5, "cast": 100.6, "encoded": 100.8, "signed": 100.81, "upload_start": 100.81,
              "uploaded": 101.2}
    log.add(_record(1))
    log.add(_record(2))
    log.published(PublishOutcome(2, True, 0.4, 900, ["delta"], stages={"step_end": 102.0}))
    assert not path.exists(), "v2 waits for v1's publish"
    log.published(PublishOutcome(1, True, 0.7, 1200, ["delta"], stages=stages))
    written = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["version"] for r in written] == [1, 2]
    assert written[0]["stages"] == stages and written[1]["stages"] == {"step_end": 102.0}
    assert written[0]["publish_bytes"] == 1200 and written[0]["published"] is True
