"""The demo's closing summary on the terminal: what was learned, what the links carried, how far each pool's
logprobs were from the trainer's (and which pools the trainer flagged), whether pools are exact, and for the
code workflows what the sandboxes made of the programs.

The bytes table sets a real model's delta (SmolLM2-135M, one Adam step at lr 5e-6: the codec tour's
figure, mesh/demo/codec_tour.py) beside the demo's own, with one line on why they differ: the demo's
tiny model trains at a learning rate a hundred times a real one's so that it learns within a minute,
and its deltas are that much less sparse."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from deltamesh.mesh.demo.codec_tour import real_step_figure
from deltamesh.mesh.demo.run import DemoResult
from deltamesh.mesh.demo.view import human_bytes


def _fmt(value: float | None, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def print_summary(console: Console, result: DemoResult) -> None:
    report = result.report
    s = report["summary"]
    console.rule(f"deltamesh demo: {result.outcome}")
    if report["error"]:
        console.print(f"[red]{report['error']}[/]")
    for model_id, m in report["models"].items():
        facts: dict[str, Any] = s.get(model_id, {})
        console.print(f"[bold]{model_id}[/]: {facts.get('steps', 0)} steps, final version v{m['final_version']}; "
                      f"mean reward {_fmt(facts.get('reward_mean'))}; "
                      f"reward {_fmt(facts.get('reward_first_third'))} (first third) -> "
                      f"{_fmt(facts.get('reward_last_third'))} (last third); "
                      f"mean trainer wait fraction {_fmt(facts.get('mean_wait_fraction'), '.2f')}")
        trained = ", ".join(f"{pool} {n}" for pool, n in sorted(m["trained_samples_by_pool"].items()))
        console.print(f"  samples trained on, by pool: {trained or '-'}")
        table = Table(title=f"{model_id}: bytes per version after v0 (mean), against a full sync")
        for col in ("link", "bytes per version", "full snapshot", "x smaller"):
            table.add_column(col, justify="left" if col == "link" else "right")
        full = facts.get("full_bytes")
        for link, mean in sorted(facts.get("mean_link_bytes_per_version", {}).items()):
            table.add_row(link, human_bytes(mean), human_bytes(full), f"{full / mean:.1f}x" if full and mean else "-")
        real = real_step_figure()
        table.add_row(f"[bold]real model[/]: SmolLM2-135M, one step at lr {real['lr']:g}", human_bytes(real["delta_bytes"]),
                      human_bytes(real["full_bytes"]), f"[bold]{real['full_bytes'] / real['delta_bytes']:.0f}x[/]")
        table.caption = (f"{_why_toy(report['config'], real)} Real model: {real['source']}; "
                         f"{real['raw_bytes'] / real['delta_bytes']:.0f}x smaller than raw bf16.")
        console.print(table)
        for row in facts.get("periodic_full_versions", []):
            links = ", ".join(f"{link} {human_bytes(n)}" for link, n in sorted(row["link_bytes"].items()))
            console.print(f"  v{row['version']} (published as delta + full, full {human_bytes(row['full_bytes'])}): "
                          f"{links or '-'}")
        print_mismatch(console, model_id, m.get("mismatch", {}))
        print_eval(console, model_id, m.get("eval", []))
    print_sandbox(console, report)
    checks = report["final_checks"]
    if checks:
        exact = sum(1 for c in checks if c["bit_exact"])
        style = "green" if exact == len(checks) else "red"
        console.print(f"[{style}]pools on the trainer's final version, bit-exact: {exact}/{len(checks)}[/]")
        for c in checks:
            if not c["bit_exact"]:
                console.print(f"  {c['pool']} {c['model_id']}: serves v{c['engine_version']}, directory "
                              f"v{c['dir_version']}, expected v{c['expected_version']}")
    console.print(f"report: {result.report_path}")
    if result.chart_path is not None:
        console.print(f"chart:  {result.chart_path}")
    console.print(f"logs:   {report['run_dir']}/logs")


def _why_toy(config: dict[str, Any], real: dict[str, Any]) -> str:
    """One line on why the demo's ratio is not the product's."""
    if config.get("model") != "tiny":
        return f"This run's model is {config.get('model')} at lr {config.get('lr'):g}."
    return (f"Why the toy's gain is small: it trains at lr {config.get('lr'):g} so as to learn in a minute, and such "
            f"a step moves most of its bf16 words; a real step at lr {real['lr']:g} leaves ~99% of them bit-identical, "
            "and a delta costs what moves.")


def print_mismatch(console: Console, model_id: str, pools: dict[str, Any]) -> None:
    """Per pool, the trainer-side mismatch on the tokens it generated at the trainer's own version, and
    the pools the trainer flagged as jumped (nothing when no batch carried such tokens)."""
    if not pools:
        return
    table = Table(title=f"{model_id}: trainer-side mismatch per pool (tokens of the trainer's own version)")
    for col in ("pool", "versions", "tokens", "mean |d logprob|", "k3 KL", "largest", "flagged at"):
        table.add_column(col, justify="left" if col in ("pool", "flagged at") else "right")
    for pool, p in pools.items():
        flagged = ", ".join(f"v{v}" for v in p["flagged_versions"])
        table.add_row(escape(pool), str(p["versions"]), str(p["tokens"]), f"{p['abs_mean']:.4f}",
                      f"{p['k3_mean']:.2g}", f"{p['abs_max']:.4f}", f"[red]{flagged}[/]" if flagged else "-")
    console.print(table)
    for pool, p in pools.items():
        if p["flagged_versions"]:
            console.print(f"  [red]pool {escape(pool)}: its logprobs jumped away from the trainer's at "
                          f"{len(p['flagged_versions'])} version(s)[/]")


def print_eval(console: Console, model_id: str, rows: list[dict[str, Any]]) -> None:
    """The evaluator's curve: held-out avg@n per scored version, with the weights hash it proved."""
    if not rows:
        return
    table = Table(title=f"{model_id}: held-out accuracy (avg@{rows[0]['samples']}, {rows[0]['problems']} problems "
                        "never trained on)")
    for col in ("version", "step", "avg@n", "by level", "weights (proven served)"):
        table.add_column(col, justify="left" if col in ("by level", "weights (proven served)") else "right")
    for r in rows:
        levels = " ".join(f"L{lv} {100 * a:.0f}%" for lv, a in r["by_level"].items())
        proof = r["weights_hash"][:16] + ("" if r["weights_match"] else " [red](not the trainer's)[/]")
        table.add_row(f"v{r['version']}", str(r["step"]), f"{100 * r['accuracy']:.1f}%", levels or "-", proof)
    console.print(table)


def _outcomes(counts: dict[str, int]) -> str:
    return ", ".join(f"{outcome} {n}" for outcome, n in counts.items())


def print_sandbox(console: Console, report: dict[str, Any]) -> None:
    """The sandboxes' test outcomes, all pools together and per pool (nothing without a code workflow)."""
    total = report["summary"].get("sandbox")
    if total is None:
        return
    console.print(f"sandbox outcomes (tests run, all pools): {_outcomes(total)}")
    for name, pool in report["pools"].items():
        if pool.get("sandbox") is not None:
            console.print(f"  {name}: {_outcomes(pool['sandbox'])}")
