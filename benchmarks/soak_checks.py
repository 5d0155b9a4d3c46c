"""The soak's invariants, checked on every reading while it runs and on the whole history at its end.

1. trajectories: every trajectory a pool's ledger says the broker acknowledged is in the broker's
   database, its group in a known state (queued, in a batch, or dropped by a policy with its reason),
   and none is in two steps of the trainer's surviving lineage (its steps after the checkpoint each
   restart resumed; what a restart rolled back was retrained, not trained twice);
2. pool versions: within one process a pool's engine version never goes down, a restarted pool never
   comes back below the version its directory held, no serve check (docs/PROOF.md) ever fails, and at
   the end each pool's directory hashes to what the trainer published for its version;
3. one hash: no version number is listed with two weights hashes by any gateway at any time (gateways
   take only versions the trainer signed), and the version each pool's directory holds is the one the
   gateways listed under its number;
4. convergence: after the last fault is healed every pool serves the head of that moment within
   `CONVERGE_BOUND_S`, and so it does after every fault healed while no other fault was on (unless the
   next fault came first); and the trainer's median wait in the quiet tail is back within `WAIT_RATIO`
   x the median before the first fault (+ `WAIT_SLACK_S`);
5. staleness: every batch the trainer acknowledged was within the broker's bound
   (batch version - oldest sample's version <= MAX_STALENESS);
6. leaks: the fds, threads and RSS of every long-lived process, and the disk of every store, grow no
   faster than the `SLOPES` bounds over any process life (or the run) of at least `JUDGE_MIN_S`.

Beside them, no service may exit unless a fault killed it (one that does is started again, so the
soak goes on, and named). A violation names its invariant, when (seconds since the soak began) and the seed; soak.py adds the
fault-log lines around it. The checks here take plain data (soak_audit.py gathers it at the end).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Sequence

INVARIANTS = {
    "trajectories": "1 acknowledged trajectories kept, accounted for, trained once",
    "pool_versions": "2 pool versions forward only, served bit-exact",
    "one_hash": "3 one weights hash per version, only signed versions applied",
    "convergence": "4 pools at the head after the faults, trainer wait normal",
    "staleness": "5 batches within the staleness bound",
    "leaks": "6 fds, threads, RSS and disk flat",
    "services": "+ no service exited unless a fault killed it",
}
CONVERGE_BOUND_S = 90.0
WAIT_RATIO, WAIT_SLACK_S = 2.0, 0.5
JUDGE_MIN_S = 300.0
SLOPES = {"fds": 1.0, "threads": 0.5, "rss_mib": 4.0, "disk_mib": 2.0}
"""Largest growth per minute that counts as flat. Established connections ("connections") are reported,
not judged: they follow the callers (and the connection caps bound them), not the process's own code."""
GROWING = {"postgres"}
"""Stores that grow by design: the broker keeps every trajectory id for good (a late resubmission is a
duplicate forever), so its database is reported per trajectory, not judged flat."""
ACCOUNTED = {"open", "fresh", "delivered", "consumed", "filtered", "stale", "retired"}
"""Group states that account for a stored trajectory (waiting for its group, queued, in a batch, or
dropped by a policy with its reason)."""


@dataclass
class Violation:
    invariant: str
    t: float
    detail: str
    seed: int
    context: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["time_s"] = round(out.pop("t"), 1)
        return out


@dataclass
class PoolTrack:
    pid: int | None = None
    engine: int | None = None
    dir_floor: int | None = None
    """The newest version the pool's directory held in an earlier process (a restart resumes from it)."""
    dir_now: int | None = None
    checks_failed: int = 0
    refused: int = 0
    """Offers refused from gateways (a bad signature, a rollback, a stale head...), over all its lives."""
    refused_now: int = 0
    samples: int = 0
    restarts: int = 0


def slope_per_min(points: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, value) points, per minute (0 for fewer than 3 points)."""
    if len(points) < 3:
        return 0.0
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return 0.0 if den == 0 else 60.0 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den


def judged_window(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The part of one process life (or series) a slope is judged on: past its first quarter (start-up
    fills caches and pools), if what is left spans at least `JUDGE_MIN_S`; else nothing."""
    if not points:
        return []
    start, end = points[0][0], points[-1][0]
    skip = start + 0.25 * (end - start)
    window = [p for p in points if p[0] >= skip]
    return window if window and window[-1][0] - window[0][0] >= JUDGE_MIN_S else []


class Invariants:
    def __init__(self, seed: int, max_staleness: int) -> None:
        self.seed, self.max_staleness = seed, max_staleness
        self.violations: list[Violation] = []
        self.figures: dict[str, dict[str, Any]] = {k: {} for k in INVARIANTS}
        self.pools: dict[str, PoolTrack] = {}
        self.hashes: dict[int, str] = {}
        self.records: list[tuple[float, dict[str, Any]]] = []

    def violate(self, invariant: str, t: float, detail: str) -> None:
        if not any(v.invariant == invariant and v.detail == detail for v in self.violations):
            self.violations.append(Violation(invariant, t, detail, self.seed))

    def held(self, invariant: str) -> bool:
        return not any(v.invariant == invariant for v in self.violations)

    # -- while it runs ---------------------------------------------------------------------------
    def pool_status(self, t: float, pool: str, pid: int | None, entry: dict[str, Any]) -> None:
        """Invariant 2 on one reading of a pool's status (its `models[MODEL]` entry)."""
        track = self.pools.setdefault(pool, PoolTrack())
        track.samples += 1
        if pid != track.pid:
            if track.pid is not None:
                track.restarts += 1
                track.dir_floor = max(v for v in (track.dir_floor, track.dir_now, -1) if v is not None)
            track.pid, track.engine, track.checks_failed, track.refused_now = pid, None, 0, 0
        engine, held = entry.get("engine_version"), entry.get("dir_version")
        if engine is not None:
            if track.engine is not None and engine < track.engine:
                self.violate("pool_versions", t, f"{pool} (pid {pid}) went back from v{track.engine} to v{engine}")
            if track.engine is None and track.dir_floor is not None and track.dir_floor >= 0 and engine < track.dir_floor:
                self.violate("pool_versions", t, f"{pool} restarted (pid {pid}) serving v{engine}, below v"
                                                  f"{track.dir_floor} that it had already written to its directory")
            track.engine = engine if track.engine is None else max(track.engine, engine)
        if held is not None:
            track.dir_now = held
        failed = int((entry.get("checks") or {}).get("failed", 0))
        if failed > track.checks_failed or entry.get("drifted"):
            self.violate("pool_versions", t, f"{pool} (pid {pid}): the engine failed its serve check: "
                                              f"{entry.get('last_check') or entry.get('last_error')}")
        track.checks_failed = max(track.checks_failed, failed)
        refused = sum((entry.get("refusals") or {}).values())
        if refused > track.refused_now:
            track.refused += refused - track.refused_now
            track.refused_now = refused

    def gateway_listing(self, t: float, region: str, versions: Iterable[dict[str, Any]]) -> None:
        """Invariant 3 on one gateway's listing of versions."""
        for v in versions:
            h = v.get("weights_hash")
            if not h:
                continue
            known = self.hashes.setdefault(int(v["version"]), h)
            if known != h:
                self.violate("one_hash", t, f"gateway {region} lists v{v['version']} with weights hash {h[:16]}, "
                                            f"another gateway or listing had {known[:16]}")

    def broker_roles(self, t: float, roles: dict[str, str]) -> None:
        active = sum(1 for r in roles.values() if r == "active")
        f = self.figures["trajectories"]
        f["most_active_brokers_seen"] = max(f.get("most_active_brokers_seen", 0), active)

    def service_exited(self, t: float, name: str, code: int | None, tail: str) -> None:
        self.violate("services", t, f"{name} exited with code {code} without a fault killing it; its log ends: "
                                    f"{tail[-600:]}")
        f = self.figures["services"]
        f["unexpected_exits"] = f.get("unexpected_exits", 0) + 1

    def trainer_record(self, t: float, record: dict[str, Any]) -> None:
        self.records.append((t, record))

    # -- at the end ------------------------------------------------------------------------------
    def lineage(self) -> list[dict[str, Any]]:
        """The trainer's steps whose updates survive: a record of step s drops every earlier record of a
        step >= s (a restart resumed a checkpoint from before them, and those steps were redone)."""
        kept: dict[int, dict[str, Any]] = {}
        for _, record in self.records:
            step = int(record["step"])
            for s in [s for s in kept if s >= step]:
                del kept[s]
            kept[step] = record
        return [kept[s] for s in sorted(kept)]

    def trajectories(self, t: float, acked: dict[str, set[str]], stored: dict[str, str]) -> None:
        """Invariant 1. `acked`: pool -> ids its ledger holds; `stored`: id -> its group's state."""
        all_acked = set().union(*acked.values()) if acked else set()
        lost = sorted(all_acked - stored.keys())
        if lost:
            self.violate("trajectories", t, f"{len(lost)} acknowledged trajectories are not in the broker's "
                                            f"database, e.g. {lost[:5]}")
        odd = sorted(i for i in all_acked & stored.keys() if stored[i] not in ACCOUNTED)
        if odd:
            self.violate("trajectories", t, f"{len(odd)} acknowledged trajectories are in groups of no known "
                                            f"state, e.g. {[(i, stored[i]) for i in odd[:5]]}")
        seen: dict[str, int] = {}
        twice = []
        for record in self.lineage():
            for i in record.get("ids", []):
                if i in seen:
                    twice.append((i, seen[i], record["step"]))
                seen[i] = int(record["step"])
        if twice:
            self.violate("trajectories", t, f"{len(twice)} trajectories trained twice (id, step, step): {twice[:5]}")
        states: dict[str, int] = {}
        for i in all_acked & stored.keys():
            states[stored[i]] = states.get(stored[i], 0) + 1
        self.figures["trajectories"].update(acked=len(all_acked), stored=len(stored), lost=len(lost),
                                            trained_twice=len(twice), trained=len(seen), by_state=states,
                                            steps=len(self.records), lineage_steps=len(self.lineage()))

    def pool_dirs(self, t: float, dirs: dict[str, dict[str, Any]]) -> None:
        """Invariants 2 and 3 on each pool's directory at the end: {"version", "manifest_hash" (the weights
        hash its manifest claims), "files_hash" (the hash of the weights its files hold), "error"}."""
        exact = 0
        for pool, d in sorted(dirs.items()):
            if d.get("error"):
                self.violate("pool_versions", t, f"{pool}: directory unreadable: {d['error']}")
                continue
            want = self.hashes.get(d["version"])
            if d["files_hash"] != d["manifest_hash"]:
                self.violate("pool_versions", t, f"{pool}: its files hash to {d['files_hash'][:16]}, not to "
                                                  f"{d['manifest_hash'][:16]} as its manifest of v{d['version']} says")
            if want is None:
                self.violate("one_hash", t, f"{pool}: holds v{d['version']}, which no gateway listed")
            elif want != d["manifest_hash"]:
                self.violate("one_hash", t, f"{pool}: holds v{d['version']} as {d['manifest_hash'][:16]}, the "
                                            f"trainer published {want[:16]}")
            elif d["files_hash"] == want:
                exact += 1
        tracks = self.pools.values()
        self.figures["pool_versions"].update(
            readings=sum(p.samples for p in tracks), restarts_seen=sum(p.restarts for p in tracks),
            dirs_bit_exact=exact, dirs=len(dirs))
        self.figures["one_hash"].update(versions_seen=len(self.hashes),
                                        refused_offers=sum(p.refused for p in tracks))

    def convergence(self, t: float, last_heal: float, head: int | None, series: dict[str, list[tuple[float, int | None]]],
                    end: float) -> dict[str, float | None]:
        """Invariant 4 (pools): seconds from `last_heal` until each pool served `head` or newer."""
        out: dict[str, float | None] = {}
        for pool, points in sorted(series.items()):
            reached = next((at for at, v in points if at >= last_heal and v is not None and head is not None
                            and v >= head), None)
            out[pool] = None if reached is None else round(reached - last_heal, 1)
            if reached is None or reached - last_heal > CONVERGE_BOUND_S:
                waited = "never" if reached is None else f"after {reached - last_heal:.0f} s"
                self.violate("convergence", t, f"{pool} reached v{head} (the head when the last fault was healed) "
                                               f"{waited}; bound {CONVERGE_BOUND_S:.0f} s (watched {end - last_heal:.0f} s)")
        done = [s for s in out.values() if s is not None]
        self.figures["convergence"].update(
            last_heal_s=round(last_heal, 1), head=head, per_pool_s=out, bound_s=CONVERGE_BOUND_S,
            median_s=round(statistics.median(done), 1) if done else None, max_s=max(done) if done else None)
        return out

    def recoveries(self, t: float, faults: list[dict[str, Any]], series: dict[str, list[tuple[float, int | None]]],
                   head_at: Callable[[float], int | None], end: float) -> list[float]:
        """Invariant 4 between faults: after each heal that leaves no fault on, the seconds until every
        pool served the head of that moment (left out when the next fault came first and within the bound)."""
        spans: dict[int, list[float]] = {}
        for e in faults:
            if e["event"] in ("inject", "heal") and "index" in e:
                spans.setdefault(e["index"], [e["t"], end])[e["event"] == "heal"] = e["t"]
        starts = sorted(a for a, _ in spans.values())
        times = []
        for index, (_, healed) in sorted(spans.items(), key=lambda kv: kv[1][1]):
            if healed >= end or any(a <= healed < b for i, (a, b) in spans.items() if i != index):
                continue
            head = head_at(healed)
            following = next((a for a in starts if a > healed), end)
            reached = [next((at for at, v in pts if at >= healed and v is not None and head is not None and v >= head),
                            None) for pts in series.values()]
            done = None if None in reached or not reached else max(reached) - healed  # type: ignore[operator]
            if done is not None and healed + done <= following:
                times.append(round(done, 1))
                if done > CONVERGE_BOUND_S:
                    self.violate("convergence", t, f"after fault #{index} was healed at {healed:.0f} s with no other "
                                                   f"on, the pools took {done:.0f} s to reach v{head}")
            elif following - healed > CONVERGE_BOUND_S:
                self.violate("convergence", t, f"after fault #{index} was healed at {healed:.0f} s, not every pool "
                                               f"reached v{head} in the {following - healed:.0f} s before the next")
        self.figures["convergence"].update(
            recoveries=len(times), recovery_median_s=statistics.median(times) if times else None,
            recovery_max_s=max(times, default=None))
        return times

    def trainer_wait(self, t: float, before: tuple[float, float], tail: tuple[float, float]) -> None:
        """Invariant 4 (trainer): median wait of its steps in `tail` against those in `before` (windows of
        seconds since the start)."""
        def median_wait(window: tuple[float, float]) -> float | None:
            waits = [r["wait_seconds"] for at, r in self.records if window[0] <= at < window[1]]
            return statistics.median(waits) if waits else None

        base, late = median_wait(before), median_wait(tail)
        self.figures["convergence"].update(wait_before_s=None if base is None else round(base, 3),
                                           wait_tail_s=None if late is None else round(late, 3))
        if late is None:
            self.violate("convergence", t, "the trainer made no step in the quiet tail")
        elif base is not None and late > WAIT_RATIO * base + WAIT_SLACK_S:
            self.violate("convergence", t, f"the trainer's median wait in the quiet tail is {late:.2f} s, "
                                           f"against {base:.2f} s before the faults")

    def staleness(self, t: float, batches: list[tuple[str, int, int]]) -> None:
        """Invariant 5: (batch id, its version, its oldest sample's version) of every acknowledged batch."""
        worst = 0
        for batch_id, version, oldest in batches:
            lag = version - oldest
            worst = max(worst, lag)
            if lag > self.max_staleness:
                self.violate("staleness", t, f"batch {batch_id} of v{version} held a sample of v{oldest}: "
                                             f"{lag} behind, bound {self.max_staleness}")
        trainer_side = max((int(r.get("staleness_max", 0)) for _, r in self.records), default=0)
        self.figures["staleness"].update(batches=len(batches), max_lag=worst, bound=self.max_staleness,
                                         trainer_side_max=trainer_side)

    def leaks(self, t: float, lives: dict[str, dict[str, list[list[tuple[float, float]]]]]) -> dict[str, dict]:
        """Invariant 6. `lives`: process or store -> measure -> one series per process life."""
        out: dict[str, dict] = {}
        for name, measures in sorted(lives.items()):
            row: dict[str, Any] = {}
            for measure, series in measures.items():
                longest = max(series, key=lambda s: s[-1][0] - s[0][0] if s else 0, default=[])
                row[f"{measure}_slope"] = round(slope_per_min(longest), 3)
                row.setdefault("judged", False)
                if name in GROWING or measure not in SLOPES:
                    continue
                bound = SLOPES[measure]
                for life in series:
                    window = judged_window(life)
                    if window and slope_per_min(window) > bound:
                        self.violate("leaks", t, f"{name}: {measure} grew {slope_per_min(window):.2f}/min over "
                                                 f"{(window[-1][0] - window[0][0]) / 60:.0f} min (bound {bound}/min)")
                    row["judged"] = row["judged"] or bool(window)
            out[name] = row
        self.figures["leaks"].update(processes=len(out), judged=sum(1 for r in out.values() if r["judged"]),
                                     judge_min_s=JUDGE_MIN_S, bounds_per_min=SLOPES)
        return out
