"""`deltamesh bench soak`: benchmarks/soak.py of this checkout run with the flags after `--`, as written.

Its flags reach soak.py unchanged (its own help, its own refusal of a bad value, with soak.py's exit
status). The command grants nothing: soak.py refuses a caller who is not root before it creates
anything, as when it is run directly. The soak run itself is tests/bench/test_soak.py's.
"""

from __future__ import annotations


def test_the_flags_after_the_double_dash_reach_the_soak(deltamesh):
    shown = deltamesh("bench", "soak", "--", "--help")
    assert shown.returncode == 0, shown.stderr
    assert "usage: soak.py" in shown.stdout and "--minutes" in shown.stdout and "--seed" in shown.stdout

    refused = deltamesh("bench", "soak", "--", "--minutes", "0", "--seed", "7", "--json")
    assert refused.returncode == 2
    assert "soak.py: error: --minutes must be > 0" in refused.stderr


def test_the_soak_flags_without_the_double_dash_are_refused_by_the_cli(deltamesh):
    run = deltamesh("bench", "soak", "--minutes", "8")
    assert run.returncode == 2 and "unrecognized arguments: --minutes" in run.stderr
