"""The soak's report: one JSON object, a terminal table, and a plot of every pool's version over time.

`result` is the JSON object `benchmarks/soak.py --json` prints (and writes to RUN_DIR/soak.json): the
faults injected per kind, the violations (each with its invariant, time, seed and the log lines around
it), the convergence after the last fault, the leak slopes per process, and each invariant's figures.
`print_tables` shows the same as rich tables; `plot` draws RUN_DIR/versions.png (matplotlib, Agg): the
version each pool's engine served over time against the trainer's head, with each fault as a band
from its injection to its healing, coloured by kind.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from soak_checks import INVARIANTS, Invariants, Violation

log = logging.getLogger(__name__)


def context_lines(v: Violation, faults: list[dict[str, Any]], logs: dict[str, Path], wall_t0: float,
                  span_s: float = 30.0) -> list[str]:
    """The fault-log lines within `span_s` of a violation, and the lines of the logs of the services its
    detail names that were written within 10 s of it."""
    import json
    import time

    out = [json.dumps(e) for e in faults if abs(e["t"] - v.t) <= span_s]
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(wall_t0 + v.t))
    for name, path in logs.items():
        if name.split("-", 1)[-1] not in v.detail and name not in v.detail:
            continue
        try:
            lines = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        near = [f"{name}: {line}" for line in lines if line[:19] and abs(_seconds(line[:19]) - _seconds(stamp)) <= 10]
        out += near[-20:]
    return out


def _seconds(stamp: str) -> float:
    import time

    try:
        return time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S"))
    except ValueError:
        return float("inf")


def result(*, seed: int, minutes: float, checks: Invariants, faults: list[dict[str, Any]],
           leaks: dict[str, dict], converged: dict[str, float | None], extra: dict[str, Any]) -> dict[str, Any]:
    counts: dict[str, int] = {}
    for e in faults:
        if e["event"] == "inject":
            counts[e["kind"]] = counts.get(e["kind"], 0) + 1
    done = [s for s in converged.values() if s is not None]
    processes = {name: {"fds_slope": row.get("fds_slope", 0.0), "rss_slope": row.get("rss_mib_slope", 0.0),
                        "threads_slope": row.get("threads_slope", 0.0),
                        "connections_slope": row.get("connections_slope", 0.0), "judged": row["judged"]}
                 for name, row in leaks.items() if "fds_slope" in row}
    disk = {name: {"disk_slope": row["disk_mib_slope"], "judged": row["judged"]}
            for name, row in leaks.items() if "disk_mib_slope" in row}
    invariants = {key: {"title": title, "held": checks.held(key), **checks.figures[key]}
                  for key, title in INVARIANTS.items()}
    return {"seed": seed, "minutes": minutes, "faults": dict(sorted(counts.items())), "faults_total": sum(counts.values()),
            "fault_kinds": len(counts), "violations": [v.as_json() for v in checks.violations],
            "converged_s_max": max(done) if len(done) == len(converged) and done else None,
            "converged_s_median": sorted(done)[len(done) // 2] if done else None, "converged_s": converged,
            "leaks": processes, "disk": disk, "invariants": invariants, **extra}


def print_tables(r: dict[str, Any], console: Console | None = None) -> None:
    console = console or Console()
    t = Table(title=f"soak: seed {r['seed']}, {r['minutes']} min of faults, {r['faults_total']} faults of "
                    f"{r['fault_kinds']} kinds")
    t.add_column("invariant")
    t.add_column("held")
    t.add_column("figures")
    for inv in r["invariants"].values():
        figures = ", ".join(f"{k} {v}" for k, v in inv.items() if k not in ("title", "held"))
        t.add_row(inv["title"], "[green]yes[/]" if inv["held"] else "[red]NO[/]", figures)
    console.print(t)
    f = Table(title="faults injected")
    f.add_column("kind")
    f.add_column("count", justify="right")
    for kind, n in r["faults"].items():
        f.add_row(kind, str(n))
    console.print(f)
    k = Table(title="leak slopes per minute (judged over process lives of 5 min or more)")
    for col in ("process", "fds", "threads", "RSS MiB", "judged"):
        k.add_column(col, justify="left" if col == "process" else "right")
    for name, row in r["leaks"].items():
        k.add_row(name, f"{row['fds_slope']:+.2f}", f"{row['threads_slope']:+.2f}", f"{row['rss_slope']:+.2f}",
                  "yes" if row["judged"] else "no")
    for name, row in r["disk"].items():
        k.add_row(f"{name} (disk MiB)", "", "", f"{row['disk_slope']:+.2f}", "yes" if row["judged"] else "no")
    console.print(k)
    c = r["converged_s"]
    console.print(f"convergence after the last fault (bound {r['invariants']['convergence'].get('bound_s')} s): "
                  + ", ".join(f"{p} {s if s is not None else 'never'}" for p, s in c.items()))
    for v in r["violations"]:
        console.print(f"[red]violation[/] of {v['invariant']} at {v['time_s']} s (seed {v['seed']}): {v['detail']}")
        for line in v["context"]:
            console.print(f"    {line}", markup=False, highlight=False)
    if not r["violations"]:
        console.print("[green]every invariant held[/]")


def plot(path: Path, pools: dict[str, list[tuple[float, int | None]]], heads: list[tuple[float, int]],
         faults: list[dict[str, Any]], title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plot")
        return None
    fig, ax = plt.subplots(figsize=(14, 6))
    kinds = sorted({e["kind"] for e in faults if e.get("kind")})
    colours = {k: plt.get_cmap("tab10")(i % 10) for i, k in enumerate(kinds)}
    opened: dict[int, dict[str, Any]] = {}
    labelled: set[str] = set()
    for e in faults:
        if e["event"] == "inject":
            opened[e["index"]] = e
        elif e["event"] == "heal" and e.get("index") in opened:
            start = opened.pop(e["index"])
            label = start["kind"] if start["kind"] not in labelled else None
            labelled.add(start["kind"])
            ax.axvspan(start["t"], max(e["t"], start["t"] + 0.5), color=colours[start["kind"]], alpha=0.18, label=label)
    if heads:
        ax.plot([t for t, _ in heads], [h for _, h in heads], color="black", linewidth=1.5, label="trainer's head")
    for pool, points in sorted(pools.items()):
        shown = [(t, v) for t, v in points if v is not None]
        ax.plot([t for t, _ in shown], [v for _, v in shown], linewidth=1, marker=".", markersize=2, label=pool)
    ax.set_xlabel("seconds since the soak began")
    ax.set_ylabel("version served")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
