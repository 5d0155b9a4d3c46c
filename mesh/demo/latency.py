"""The latency budget of each version: from the trainer's step end to every pool serving it, stage by stage.

Three sources meet here, each stamped with wall-clock time (`time.time()`) on the host where the stage
happened (in the demo all hosts are one machine; across real hosts the clocks are assumed NTP-synced,
and a skew shows as a shifted stage): the trainer's step record (`stages`: step_end, cast, encoded,
signed, upload_start, uploaded; trainer/step_log.py), every gateway's version listing (`stored_at`: the
origin's gives `origin_stored`, each relay's `relay_stored:<region>`), and each pool's timeline
(`pool:<name>:<stage>` for head, fetched, verified, applied, persisted, serving; mesh/pool/timeline.py).

`version_times` gathers them from the demo's `MeshState` into one plain dict per version, as recorded
(report.json keeps it); everything else is a pure function of such dicts: `version_latency` gives each
stage in seconds after step_end, with the aggregates `all_relays_stored` and `all_pools_serving` (the
latest host, present only once every host has it); `increments` gives each stage's time since the
stage before it on the same host (the origin: since the upload started; a relay: since its upstream
held the version; a pool's first stage: since the origin held it; all_relays_stored: since the origin
held it; all_pools_serving: since all relays held it); `latency_medians` takes the medians over the versions after the first
(the first pays one-time warm-up). A pool's stages for a version it never took on its own (a full
snapshot jumped over it) are those of the first newer version it took: it serves that version's
weights from then on.
"""

from __future__ import annotations

import statistics
from typing import Any

from deltamesh.mesh.demo.state import MeshState

TRAINER_STAGES = ("step_end", "cast", "encoded", "signed", "upload_start", "uploaded")


def version_times(state: MeshState, model_id: str, record: dict[str, Any]) -> dict[str, Any]:
    """The wall-clock times of one version (the trainer's step `record`) on every host, as one dict."""
    run = state.models[model_id]
    v = int(record["version"])
    facts = run.versions.get(v)
    payload = facts.payload if facts is not None else {}
    pools = {}
    for name in state.pools:
        taken = [u for u in sorted(run.versions) if u >= v and name in run.versions[u].pool_stages]
        pools[name] = dict(run.versions[taken[0]].pool_stages[name]) if taken else {}
    return {
        "version": v, "step_time": record["time"], "trainer": dict(record.get("stages") or {}),
        "upstreams": dict(state.upstreams),
        "stored_at": {region: (facts.stored_at.get(region) if facts is not None else None) for region in state.upstreams},
        "pools": pools, "bytes": payload.get("delta", payload.get("full")),
    }


def version_latency(times: dict[str, Any]) -> dict[str, Any]:
    """{"version", "stages": {stage: seconds after step_end}, "all_pools_seconds", "bytes"} of one version."""
    trainer = times["trainer"]
    t0 = trainer.get("step_end", times["step_time"])  # a trainer without stage times: its step record's time
    stages = {k: t - t0 for k, t in sorted(trainer.items(), key=lambda kv: kv[1])}
    upstreams, stored = times["upstreams"], times["stored_at"]
    for region, upstream in upstreams.items():
        if stored.get(region) is not None:
            stages["origin_stored" if not upstream else f"relay_stored:{region}"] = stored[region] - t0
    relays = [f"relay_stored:{r}" for r, up in upstreams.items() if up]
    if relays and all(r in stages for r in relays):
        stages["all_relays_stored"] = max(stages[r] for r in relays)
    for pool, marks in sorted(times["pools"].items()):
        for stage, t in sorted(marks.items(), key=lambda kv: kv[1]):
            stages[f"pool:{pool}:{stage}"] = t - t0
    serving = [f"pool:{p}:serving" for p in times["pools"]]
    if serving and all(s in stages for s in serving):
        stages["all_pools_serving"] = max(stages[s] for s in serving)
    return {"version": times["version"], "stages": stages, "all_pools_seconds": stages.get("all_pools_serving"),
            "bytes": times["bytes"]}


def _host(stage: str) -> str:
    return stage.rsplit(":", 1)[0] if stage.startswith("pool:") else ""


def increments(stages: dict[str, float], upstreams: dict[str, str]) -> dict[str, float]:
    """Each stage's seconds since the stage before it on the same host (see the module docstring)."""
    out: dict[str, float] = {}
    trainer = sorted((k for k in stages if k in TRAINER_STAGES), key=stages.__getitem__)
    for before, k in zip(trainer, trainer[1:]):
        out[k] = stages[k] - stages[before]
    origin = stages.get("origin_stored")
    if origin is not None and trainer:
        # The origin holds the version once the upload's bytes are in, before the trainer hears back.
        out["origin_stored"] = origin - stages.get("upload_start", stages[trainer[-1]])
    for region, upstream in upstreams.items():
        k = f"relay_stored:{region}"
        base = stages.get(f"relay_stored:{upstream}", origin)
        if upstream and k in stages and base is not None:
            out[k] = stages[k] - base
    if "all_relays_stored" in stages and origin is not None:
        out["all_relays_stored"] = stages["all_relays_stored"] - origin
    hosts: dict[str, list[str]] = {}
    for k in stages:
        if k.startswith("pool:"):
            hosts.setdefault(_host(k), []).append(k)
    for keys in hosts.values():
        keys.sort(key=stages.__getitem__)
        previous = origin
        for k in keys:
            if previous is not None:
                out[k] = stages[k] - previous
            previous = stages[k]
    if "all_pools_serving" in stages:
        base = stages.get("all_relays_stored", origin)
        if base is not None:
            out["all_pools_serving"] = stages["all_pools_serving"] - base
    return out


def latency_medians(times: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the versions after the first: {"versions", "stages": {stage: seconds after step_end},
    "increments": {stage: seconds since the stage before it}, "all_pools_seconds", "bytes"}."""
    later = times[1:] or times
    rows = [version_latency(t) for t in later]
    steps = [increments(r["stages"], t["upstreams"]) for r, t in zip(rows, later)]

    def medians(dicts: list[dict[str, float]]) -> dict[str, float]:
        keys = list(dict.fromkeys(k for d in dicts for k in d))
        return {k: statistics.median(d[k] for d in dicts if k in d) for k in keys}

    def median(values: list[Any]) -> float | None:
        present = [x for x in values if x is not None]
        return statistics.median(present) if present else None

    return {"versions": [r["version"] for r in rows], "stages": medians([r["stages"] for r in rows]),
            "increments": medians(steps), "all_pools_seconds": median([r["all_pools_seconds"] for r in rows]),
            "bytes": median([r["bytes"] for r in rows])}


def latency(state: MeshState, model_id: str) -> dict[str, Any]:
    """A model's latency budget for report.json: {"versions": [version_latency rows], "medians", "times"}."""
    times = [version_times(state, model_id, r) for r in state.models[model_id].steps if r.get("published", True)]
    return {"versions": [version_latency(t) for t in times], "medians": latency_medians(times), "times": times}
