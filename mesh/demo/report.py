"""The run report: `report.json` (per step and per version figures, final checks, summary) and `report.png`.

Per step of each policy: reward, version, the bytes each link carried for that version against the
full snapshot's size, the trainer's wait fraction and timings, how far behind each pool was, how
many samples each pool contributed, how long after the step the last pool served the version, and
each pool's trainer-side mismatch on the tokens it generated at the version trained on (the mean
absolute difference of trainer and behaviour logprobs, the k3 KL estimate, and whether the trainer
flagged the pool as jumped; `deltamesh.trainer.mismatch`). Per policy, `mismatch` sums that up per
pool (token-weighted means, the versions it was flagged at); the summary names the flagged pools.
Per policy, `latency` follows each version from the trainer's step end through the gateways to every
pool serving it, stage by stage, with the medians and the recorded wall-clock times
(mesh/demo/latency.py). Per pool, for the code workflows, the outcome counts of its sandbox's tests (passed, failed, error,
timeout, resource_limit), and their sum in the summary.
Per policy scored by the evaluator, `eval`: each scored version's held-out avg@n, its step and wall
time, and whether the weights hash its engine proved matches the trainer's for that version.
The chart (matplotlib, Agg backend, no display needed) shows reward per step, on a log scale the
bytes per version on each link with the full-sync size as a dashed line, and the held-out accuracy
per step when an evaluator ran. The mismatch stays in the
JSON and the terminal summary, not the chart: it is measured only on tokens generated at the
trainer's own version, which a short run has at a handful of versions, too few points to read a
trend from. The summary also lists, per version published as delta + full (the periodic full
syncs), what each link carried for it.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltamesh.config import to_dict
from deltamesh.mesh.demo.config import DemoConfig
from deltamesh.mesh.demo.latency import latency
from deltamesh.mesh.demo.state import MeshState
from deltamesh.mesh.sandbox import Outcome


@dataclass
class FinalCheck:
    """Whether a pool ended on its trainer's final version, bit-exact (by the weights hash)."""

    pool: str
    model_id: str
    engine_version: int | None
    dir_version: int | None
    dir_weights_hash: str
    expected_version: int | None
    expected_hash: str

    @property
    def bit_exact(self) -> bool:
        return (self.expected_version is not None and self.engine_version == self.expected_version
                and self.dir_version == self.expected_version and self.dir_weights_hash == self.expected_hash)


def thirds(values: list[float]) -> tuple[float | None, float | None]:
    """Mean of the first and of the last third of `values` (None when there are fewer than three)."""
    k = len(values) // 3
    if k == 0:
        return None, None
    return statistics.fmean(values[:k]), statistics.fmean(values[-k:])


def step_rows(state: MeshState, model_id: str) -> list[dict[str, Any]]:
    run = state.models[model_id]
    rows = []
    for r in run.steps:
        v = int(r["version"])
        facts = run.versions.get(v)
        everywhere = state.all_pools_at(model_id, v)
        # What each pool served when the step ended: how far behind the trainer it was then.
        served = {p: state.served_at_time(p, model_id, r["time"]) for p in state.pools}
        rows.append({
            "step": r["step"], "version": v, "reward": r["reward_mean"], "samples": r["samples"],
            "pools": r.get("pools", {}), "wait_fraction": r["wait_fraction"], "wait_seconds": r["wait_seconds"],
            "train_seconds": r["train_seconds"], "publish_seconds": r.get("publish_seconds"),
            "publish_kinds": r.get("publish_kinds", []), "staleness_mean": r["staleness_mean"],
            "staleness_max": r.get("staleness_max", 0), "step_seconds": r.get("step_seconds"), "time": r["time"],
            "link_bytes": dict(facts.link_bytes) if facts else {}, "full_bytes": run.full_bytes_at(v),
            "all_pools_seconds": None if everywhere is None else max(0.0, everywhere - r["time"]),
            "pool_behind": {p: None if pv is None else max(0, v - pv) for p, pv in served.items()},
            "mismatch_version": (r.get("mismatch") or {}).get("version"),
            "mismatch": (r.get("mismatch") or {}).get("pools", {}),
        })
    return rows


def mismatch_by_pool(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per pool over the steps: versions measured, tokens, token-weighted mean |d| and k3, the largest
    batch mean |d|, and the versions at which the trainer flagged the pool."""
    out: dict[str, Any] = {}
    for row in rows:
        for pool, r in row["mismatch"].items():
            acc = out.setdefault(pool, {"versions": 0, "tokens": 0, "abs_mean": 0.0, "k3_mean": 0.0, "abs_max": 0.0,
                                        "flagged_versions": []})
            acc["versions"] += 1
            acc["tokens"] += r["tokens"]
            acc["abs_mean"] += r["abs"] * r["tokens"]  # sums here, divided below
            acc["k3_mean"] += r["k3"] * r["tokens"]
            acc["abs_max"] = max(acc["abs_max"], r["abs"])
            if r["flagged"]:
                acc["flagged_versions"].append(row["mismatch_version"])
    for acc in out.values():
        acc["abs_mean"] /= max(acc["tokens"], 1)
        acc["k3_mean"] /= max(acc["tokens"], 1)
    return dict(sorted(out.items()))


def eval_rows(state: MeshState, model_id: str) -> list[dict[str, Any]]:
    """The evaluator's results as the curve: per scored version, its step (the trainer step that made
    it; 0 for the initial weights), the seconds from the run's start (`wall_s`) and from the start of
    training (`train_s`: the first step's poll) to that step's end, avg@n and its parts, and the
    weights hash the evaluator's engine proved it served."""
    steps = state.models[model_id].steps
    ends = {int(r["version"]): (int(r["step"]), float(r["time"])) for r in steps}
    # Training starts when the first step's poll began (its end less its length).
    first = float(steps[0]["time"]) - float(steps[0].get("step_seconds") or 0.0) if steps else state.started_at
    rows = []
    for r in state.evals:
        step, at = ends.get(int(r["version"]), (int(r["version"]), None))
        rows.append({"version": r["version"], "step": 0 if r["version"] == 0 else step,
                     "wall_s": None if at is None else at - state.started_at,
                     "train_s": 0.0 if r["version"] == 0 else (None if at is None else at - first),
                     "accuracy": r["accuracy"], "correct": r["correct"], "problems": r["problems"],
                     "samples": r["samples"], "by_level": r.get("by_level", {}), "weights_hash": r["weights_hash"],
                     "weights_match": state.models[model_id].versions.get(int(r["version"])) is None
                     or state.models[model_id].versions[int(r["version"])].weights_hash in ("", r["weights_hash"])})
    return rows


def build_report(state: MeshState, config: DemoConfig, *, run_dir: Path, outcome: str, error: str,
                 checks: list[FinalCheck], processes: list[dict[str, Any]]) -> dict[str, Any]:
    models: dict[str, Any] = {}
    for model_id, run in state.models.items():
        rows = step_rows(state, model_id)
        first, last = thirds([row["reward"] for row in rows])
        trained = Counter()
        for row in rows:
            trained.update(row["pools"])
        final = run.trainer_version
        models[model_id] = {
            "steps": rows, "final_version": final,
            "final_weights_hash": run.versions[final].weights_hash if final in run.versions else "",
            "reward_first_third": first, "reward_last_third": last, "trained_samples_by_pool": dict(trained),
            "mismatch": mismatch_by_pool(rows), "latency": latency(state, model_id),
            "eval": eval_rows(state, model_id) if model_id == config.model_ids[0] else [],
        }
    pools = {}
    for name, p in state.pools.items():
        pools[name] = {
            "region": p.region, "submitted": p.submitted(), "pulled_bytes": dict(p.pulled),
            "sandbox": sandbox_totals([p.sandbox_counts()]),
            "moves": {m: [{"version": v, "at": at, "pulled_bytes": b} for v, at, b in moves]
                      for m, moves in p.moves.items()},
        }
    links = {name: {"bandwidth_mbps": r.bandwidth_mbps, "delay_ms": r.delay_ms, "rtt_ms_p50": r.rtt_ms,
                    "bytes_total": r.bytes_total} for name, r in state.links.items()}
    return {
        "config": to_dict(config), "run_dir": str(run_dir), "outcome": outcome, "error": error,
        "started_at": state.started_at, "models": models, "pools": pools, "links": links,
        "final_checks": [{**to_dict(c), "bit_exact": c.bit_exact} for c in checks],
        "processes": processes, "summary": summary(models, checks, pools),
    }


def sandbox_totals(readings: list[dict[str, int] | None]) -> dict[str, int] | None:
    """Sandbox outcome counts added up, every outcome listed (0 if never seen); None when none ran one."""
    counted = [c for c in readings if c is not None]
    if not counted:
        return None
    total: Counter[str] = Counter()
    for counts in counted:
        total.update(counts)
    return {o.value: total[o.value] for o in Outcome}


def summary(models: dict[str, Any], checks: list[FinalCheck], pools: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {"all_pools_bit_exact": bool(checks) and all(c.bit_exact for c in checks),
                           "sandbox": sandbox_totals([p["sandbox"] for p in pools.values()])}
    for model_id, m in models.items():
        rows = m["steps"][1:] if len(m["steps"]) > 1 else m["steps"]  # v1 onwards: deltas, not the first sync
        per_link: dict[str, list[int]] = {}
        for row in rows:
            for link, n in row["link_bytes"].items():
                per_link.setdefault(link, []).append(n)
        fulls = [row["full_bytes"] for row in rows if row["full_bytes"]]
        out[model_id] = {
            "steps": len(m["steps"]), "final_version": m["final_version"],
            "reward_first_third": m["reward_first_third"], "reward_last_third": m["reward_last_third"],
            # Also for runs too short for thirds (a smoke run of a few steps).
            "reward_mean": statistics.fmean(r["reward"] for r in m["steps"]) if m["steps"] else None,
            "mean_wait_fraction": statistics.fmean(r["wait_fraction"] for r in m["steps"]) if m["steps"] else None,
            "mean_link_bytes_per_version": {k: statistics.fmean(v) for k, v in per_link.items()},
            "full_bytes": statistics.median(fulls) if fulls else None,
            # The periodic full syncs: what each link carried for a version published as delta + full.
            "periodic_full_versions": [{"version": row["version"], "full_bytes": row["full_bytes"],
                                        "link_bytes": row["link_bytes"]}
                                       for row in m["steps"] if "full" in row["publish_kinds"] and row["version"]],
            # Held-out avg@n of the first and the last scored version (the evaluator's curve is in models.*.eval).
            "eval_first": m["eval"][0] if m["eval"] else None, "eval_last": m["eval"][-1] if m["eval"] else None,
            # The pools whose logprobs the trainer saw jump away from its own, and at which versions.
            "mismatch_flagged": {pool: p["flagged_versions"] for pool, p in m["mismatch"].items()
                                 if p["flagged_versions"]},
        }
    return out


def write_report(run_dir: Path, report: dict[str, Any]) -> tuple[Path, Path | None]:
    """Write report.json and report.png; the chart is skipped (None) when there is nothing to plot."""
    json_path = run_dir / "report.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    if not any(m["steps"] for m in report["models"].values()):
        return json_path, None
    return json_path, plot(report, run_dir / "report.png")


def plot(report: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    evals = {model_id: m["eval"] for model_id, m in report["models"].items() if m.get("eval")}
    fig, axes = plt.subplots(3 if evals else 2, 1, figsize=(9, 12 if evals else 8))
    ax_reward, ax_bytes = axes[0], axes[1]
    for model_id, rows in evals.items():
        ax = axes[2]
        ax.plot([r["step"] for r in rows], [100 * r["accuracy"] for r in rows], marker="o", label=model_id)
        n = rows[0]["samples"]
        ax.set_title(f"held-out accuracy (avg@{n} on {rows[0]['problems']} problems never trained on)")
        ax.set_xlabel("trainer step (version)")
        ax.set_ylabel(f"avg@{n}, %")
        ax.legend(fontsize=8)
    for model_id, m in report["models"].items():
        steps = [r["step"] for r in m["steps"]]
        rewards = [r["reward"] for r in m["steps"]]
        ax_reward.plot(steps, rewards, marker=".", linewidth=1, label=f"{model_id}: batch mean")
        window = [statistics.fmean(rewards[max(0, i - 4):i + 1]) for i in range(len(rewards))]
        ax_reward.plot(steps, window, linewidth=2, label=f"{model_id}: mean of last 5")
        links = sorted({link for r in m["steps"] for link in r["link_bytes"]})
        for link in links:
            # A version with no changed word costs 0 bytes: no point on a log scale.
            points = [(r["version"], r["link_bytes"][link]) for r in m["steps"] if r["link_bytes"].get(link)]
            ax_bytes.plot([p[0] for p in points], [p[1] for p in points], marker=".", linewidth=1,
                          label=f"{link}" + (f" [{model_id}]" if len(report["models"]) > 1 else ""))
        fulls = [(r["version"], r["full_bytes"]) for r in m["steps"] if r["full_bytes"]]
        if fulls:
            ax_bytes.plot([p[0] for p in fulls], [p[1] for p in fulls], linestyle="--", color="gray",
                          label="full snapshot (what a full sync costs)")
    ax_reward.set_xlabel("trainer step")
    ax_reward.set_ylabel("reward")
    ax_reward.set_title("reward per step")
    ax_reward.legend(fontsize=8)
    ax_bytes.set_yscale("log")
    ax_bytes.set_xlabel("version")
    ax_bytes.set_ylabel("bytes on the link for this version")
    ax_bytes.set_title("bytes per version on each link (the upload spikes with each periodic full;\n"
                       "relays carry a full only when a pool asks for one)")
    ax_bytes.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
