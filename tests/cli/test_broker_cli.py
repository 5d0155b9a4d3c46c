"""`deltamesh broker`: it refuses bad settings with a clear message and exit code 2, and a
second broker cannot open a database another broker is using."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deltamesh.mesh.cli import build_parser

DELTAMESH = [sys.executable, "-c", "import sys; from deltamesh.mesh.cli import main; sys.exit(main())"]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*DELTAMESH, *args], capture_output=True, text=True, timeout=60)


def test_bad_settings_exit_2_with_the_reason(tmp_path, caplog):
    cfg = tmp_path / "b.toml"
    cases = [('[broker]\nmodls = ["m"]\n', [], "unknown keys ['modls']"),
             ('[broker.policies]\nfilters = ["nope"]\n', [], "unknown filter 'nope'"),
             ('[broker.policies.replay]\nfraction = 1.5\n', [], "replay.fraction must be in [0, 1)"),
             ('[broker.tasks.curator]\nname = "psychic"\n', [], "unknown curator 'psychic'"),
             ("", ["--dataset", str(tmp_path / "missing.jsonl")], "cannot read dataset")]
    for text, extra, reason in cases:
        cfg.write_text(text)
        args = build_parser().parse_args(["broker", "--anonymous", "--db", str(tmp_path / "b.db"), "--config", str(cfg),
                                          "--listen", "127.0.0.1:0", *extra])
        caplog.clear()
        assert args.run(args) == 2 and reason in caplog.text, caplog.text


@pytest.mark.slow
def test_a_second_broker_cannot_share_the_database(broker_process, tmp_path):
    first = broker_process()
    first.start()
    done = run("broker", "--anonymous", "--db", str(first.db), "--listen", "127.0.0.1:0")
    assert done.returncode == 2 and "database is locked" in done.stderr, done.stderr
    assert first.get("/v1/status")["models"]["m"]["version"] == 0  # the first one is unharmed
