"""The demo's terminal view: rich tables redrawn in place, or plain progress lines when not on a terminal.

`render` builds the live view from a `MeshState`: the trainers (step, reward, wait fraction, where
a step's time goes), the pools (region, version served, versions behind the trainer, what they
pulled, their latest trainer-side mismatch, in red when the trainer flagged them; for a code
workflow, how many of its sandbox's tests passed), the links (added latency
and cap, measured RTT, bytes per version against what a full sync would have cost), and the
evaluator's held-out curve when one runs. `ProgressLines`
gives one log line per new trainer step instead, for logs, CI and tests.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from rich.console import Group, RenderableType
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from deltamesh.mesh.demo.config import DemoConfig
from deltamesh.mesh.demo.state import MeshState, ModelRun


def human_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.0f} ms" if value >= 10 else f"{value:.1f} ms"


def link_versions(run: ModelRun, link: str) -> list[tuple[int, int]]:
    """(version, bytes) the link carried per version after v0 (v0 is the first full sync)."""
    return sorted((v, f.link_bytes[link]) for v, f in run.versions.items() if v > 0 and link in f.link_bytes)


def _trainers(state: MeshState, config: DemoConfig) -> Table:
    t = Table(title="trainers", title_justify="left")
    for col in ("policy", "step", "version", "reward", "reward (last 5)", "wait fraction", "train s", "publish"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for model_id, run in state.models.items():
        if not run.steps:
            t.add_row(model_id, f"0/{config.steps}", "-", "-", "-", "-", "-", "waiting for data")
            continue
        r = run.steps[-1]
        recent = run.steps[-5:]
        publish = (f"{'+'.join(r.get('publish_kinds', []))} {human_bytes(r.get('publish_bytes'))} "
                   f"{r.get('publish_seconds', 0):.2f} s") if r.get("published") else "failed"
        t.add_row(model_id, f"{r['step']}/{config.steps}", f"v{r['version']}", f"{r['reward_mean']:.2f}",
                  f"{statistics.fmean(x['reward_mean'] for x in recent):.2f}", f"{r['wait_fraction']:.2f}",
                  f"{r['train_seconds']:.2f}", publish)
    return t


def _mismatch(reading: dict[str, Any] | None) -> str:
    """A pool's latest mean |trainer - behaviour logprob|, red and marked when the trainer flagged it."""
    if reading is None:
        return "-"
    return f"[red]{reading['abs']:.3f} jumped[/]" if reading["flagged"] else f"{reading['abs']:.3f}"


def _pools(state: MeshState, config: DemoConfig) -> Table:
    t = Table(title="rollout pools", title_justify="left")
    cols = ["pool", "region", "hops", "serves", "behind trainer", "leasing", "samples sent", "pulled", "RTT",
            "mismatch"]
    if config.needs_sandbox:
        cols.append("sandbox tests passed/run")
    for col in cols:
        t.add_column(col, justify="left" if col in ("pool", "region", "leasing") else "right")
    for name, p in state.pools.items():
        serves, behind, mismatch = [], [], []
        for model_id in state.model_ids:
            v = p.engine_version(model_id)
            serves.append("-" if v is None else f"v{v}")
            b = state.pool_behind(name, model_id)
            behind.append("-" if b is None else str(b))
            mismatch.append(_mismatch(state.pool_mismatch(name, model_id)))
        leasing = p.status.get("leasing") or {}
        verdict = "starting" if not p.status else ("yes" if leasing.get("may_lease") else
                                                   (leasing.get("reason") or "no")[:40])
        row = [name, p.region, str(config.topology.hops(p.region)), " ".join(serves), " ".join(behind), verdict,
               str(p.submitted()), human_bytes(sum(p.pulled.values())), _ms(p.rtt_ms), " ".join(mismatch)]
        if config.needs_sandbox:
            counts = p.sandbox_counts() or {}
            row.append(f"{counts.get('passed', 0)}/{sum(counts.values())}")
        t.add_row(*row)
    return t


def _links(state: MeshState, config: DemoConfig, upload_link: str) -> Table:
    t = Table(title="links (bytes per version: what each version cost on the link, vs a full sync)",
              title_justify="left")
    for col in ("link", "cap", "added latency", "RTT p50", "last version", "mean per version", "full sync",
                "x smaller"):
        t.add_column(col, justify="left" if col == "link" else "right")
    rows = [(upload_link, None)] + [(name, reading) for name, reading in state.links.items()]
    for name, reading in rows:
        for model_id, run in state.models.items():
            carried = link_versions(run, name)
            label = name if len(state.models) == 1 else escape(f"{name} [{model_id}]")  # not rich markup
            last = f"v{carried[-1][0]}: {human_bytes(carried[-1][1])}" if carried else "-"
            mean = statistics.fmean(b for _, b in carried) if carried else None
            full = run.full_bytes or None
            ratio = f"{full / mean:.1f}x" if full and mean else "-"
            cap = "-" if reading is None or not reading.bandwidth_mbps else f"{reading.bandwidth_mbps:g} Mbit/s"
            delay = "-" if reading is None or not reading.delay_ms else f"+{reading.delay_ms:g} ms"
            rtt = "-" if reading is None else _ms(reading.rtt_ms)
            t.add_row(label, cap, delay, rtt, last, human_bytes(mean), human_bytes(full), ratio)
    return t


def eval_line(state: MeshState, config: DemoConfig) -> str:
    """The evaluator's curve so far: held-out avg@n per scored version, and what it does now."""
    if not config.eval.every:
        return ""
    curve = " ".join(f"v{r['version']} {100 * r['accuracy']:.0f}%" for r in state.evals) or "-"
    st = state.eval_status
    doing = (f"scoring v{st['scoring']}" if st.get("scoring") is not None else
             f"holds v{st.get('engine_version')}, {st.get('waiting', 0)} waiting") if st else "starting"
    return (f"held-out avg@{config.eval.samples} ({config.model_ids[0]}, {config.eval.problems} problems never "
            f"trained on): {curve}  |  evaluator {doing}")


def render(state: MeshState, config: DemoConfig, upload_link: str, run_dir: str) -> RenderableType:
    elapsed = time.time() - state.started_at
    head = Text.assemble(
        ("deltamesh demo", "bold"), f"  {config.model} model, workflow {config.workflow}, {config.steps} steps, "
        f"{len(config.topology.pools)} pools in {len(config.topology.gateways)} regions  |  {state.phase}  |  "
        f"{elapsed:.0f} s  |  {run_dir}")
    note = "link latency and caps are emulated in the application (gateway link_delay_ms, bandwidth_cap_mbps)"
    if config.model == "tiny":
        note += (f"; the tiny random-init model learns at lr {config.lr:g}, which moves most bf16 words each "
                 "step, so its deltas are only a little smaller than a full snapshot (--model smollm2 runs the "
                 "real model at lr 5e-6)")
    parts: list[Any] = [head, _trainers(state, config), _pools(state, config), _links(state, config, upload_link)]
    if config.eval.every:
        parts.append(Text(escape(eval_line(state, config)), style="bold"))
    parts.append(Text(note, style="dim"))
    parts += [Text(n, style="yellow") for n in state.notes[-3:]]
    return Group(*parts)


class ProgressLines:
    """Plain one-line progress for each new trainer step (when stdout is not a terminal)."""

    def __init__(self) -> None:
        self._shown: dict[str, int] = {}
        self._evals = 0

    def lines(self, state: MeshState) -> list[str]:
        out = []
        for model_id, run in state.models.items():
            for r in run.steps[self._shown.get(model_id, 0):]:
                pools = " ".join(f"{name} v{p.engine_version(model_id)}" for name, p in state.pools.items())
                links = " ".join(f"{name} {human_bytes(run.versions[r['version']].link_bytes.get(name))}"
                                 for name in state.links if r["version"] in run.versions)
                flagged = [p for p, m in (r.get("mismatch") or {}).get("pools", {}).items() if m["flagged"]]
                out.append(f"{model_id} step {r['step']} v{r['version']}: reward {r['reward_mean']:.3f} "
                           f"wait fraction {r['wait_fraction']:.2f} train {r['train_seconds']:.2f} s "
                           f"publish {human_bytes(r.get('publish_bytes'))} | pools {pools} | links {links}"
                           + (f" | mismatch jumped: {' '.join(flagged)}" if flagged else ""))
            self._shown[model_id] = len(run.steps)
        for r in state.evals[self._evals:]:
            out.append(f"eval v{r['version']}: held-out avg@{r['samples']} {r['accuracy']:.3f} "
                       f"({r['correct']}/{r['samples'] * r['problems']}) weights {r['weights_hash'][:16]}")
        self._evals = len(state.evals)
        return out
