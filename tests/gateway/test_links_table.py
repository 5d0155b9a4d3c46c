"""`deltamesh links` output: the full table where it fits, a compact one (one line per link) at 80 columns."""

from __future__ import annotations

import io

from rich.console import Console

from deltamesh.mesh.cli.links import links_table

ANSWER = {"region": "regionA", "links": [
    {"peer": "http://10.78.0.1:8600", "role": "upstream", "rtt_ms": {"p50": 150.31, "p95": 151.02},
     "throughput_bps": 11.8e6, "bytes_total": 209_715_200, "errors": 0, "last_error": "", "last_transfer_s": 3.2},
    {"peer": "regionB", "role": "downstream", "rtt_ms": {"p50": 25.0, "p95": 26.4}, "throughput_bps": None,
     "bytes_total": 0, "errors": 2, "last_transfer_s": None,
     "last_error": "ClientConnectorError: Cannot connect to host 10.78.1.2:8600 ssl:default [Connect call failed]"},
    {"peer": "pool-a1.solver", "role": "pool", "rtt_ms": {"p50": 0.12, "p95": 0.3}, "throughput_bps": 523e6,
     "bytes_total": 1_234_567_890, "errors": 0, "last_error": "", "last_transfer_s": 12.5},
]}


def render(width: int) -> list[str]:
    """The output as a pipe gets it (no terminal, no colour) at `width` columns."""
    out = io.StringIO()
    console = Console(file=out, width=width, force_terminal=False, no_color=True)
    console.print(links_table(ANSWER, console))
    return out.getvalue().splitlines()


def test_at_80_columns_each_link_is_one_line_and_errors_follow_the_table():
    lines = render(80)
    assert max(len(line) for line in lines) <= 80
    assert "links of region regionA" in lines[0]
    rows = {words[0]: words for words in map(str.split, lines) if words}  # by each line's first word
    assert rows["http://10.78.0.1:8600"] == ["http://10.78.0.1:8600", "upstream", "150.31", "11.8", "MB/s", "209.7",
                                             "MB", "0", "3.2s", "ago"]
    assert rows["regionB"] == ["regionB", "downstream", "25.00", "-", "0", "B", "2", "-"]
    assert rows["pool-a1.solver"][3:5] == ["523.0", "MB/s"] and rows["pool-a1.solver"][5:7] == ["1.2", "GB"]
    assert any(line.startswith("regionB: ClientConnectorError: Cannot connect") for line in lines)


def test_a_wide_console_gets_every_column():
    lines = render(200)
    header = next(line for line in lines if "peer" in line)
    for column in ("rtt p50 ms", "rtt p95 ms", "throughput", "bytes", "errors", "last transfer", "last error"):
        assert column in header
    row = next(line for line in lines if "upstream" in line)
    cells = [cell.strip() for cell in row.split("│")]
    assert cells[1:9] == ["http://10.78.0.1:8600", "upstream", "150.31", "151.02", "11.8 MB/s", "209,715,200", "0",
                          "3.2s ago"]
