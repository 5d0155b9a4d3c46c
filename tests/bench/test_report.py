"""benchmarks/report.py draws BENCHMARKS.md's plots from a results file of `benchmarks/run_all.py
--json`: from the recorded one (benchmarks/results_recorded.json, the runs the docs' plots come from)
every plot is drawn as a PNG; a results file without a benchmark leaves its plot out, and says so.
run_all.py --json gathers each benchmark's JSON object into that file's shape."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import report

RECORDED = Path(__file__).resolve().parents[2] / "benchmarks" / "results_recorded.json"
PNG = b"\x89PNG\r\n\x1a\n"


def test_every_plot_is_drawn_from_the_recorded_results(tmp_path):
    written = report.draw(json.loads(RECORDED.read_text()), tmp_path)
    assert sorted(p.name for p in written) == sorted(report.PLOTS)
    for path in written:
        data = path.read_bytes()
        assert data.startswith(PNG) and len(data) > 20_000, path.name


def test_a_missing_benchmark_leaves_its_plot_out(tmp_path, capsys):
    results = json.loads(RECORDED.read_text())
    del results["results"]["transfer"], results["results"]["broker"]
    path = tmp_path / "results.json"
    path.write_text(json.dumps(results))
    assert report.main([str(path), "--out", str(tmp_path / "figures")]) == 0
    assert sorted(p.name for p in (tmp_path / "figures").iterdir()) == ["codec_ratio.png", "latency_stages.png"]
    out = capsys.readouterr().out
    assert "transfer_utilization.png: no data in the results file" in out and "codec_ratio.png: written" in out


@pytest.mark.slow
def test_run_all_gathers_each_benchmarks_json_into_one_results_file(tmp_path):
    saved = tmp_path / "results.json"
    done = subprocess.run([sys.executable, str(RECORDED.parent / "run_all.py"), "--json", "--only", "simulate",
                           "--save", str(saved)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    gathered = json.loads(done.stdout.splitlines()[-1])
    assert gathered == json.loads(saved.read_text())
    assert set(gathered) == {"date", "commit", "machine", "results"} and list(gathered["results"]) == ["simulate"]
    assert gathered["results"]["simulate"]  # simulate.py's own object
