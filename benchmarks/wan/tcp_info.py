"""Reading `ss -tin` (iproute2): each TCP connection's two ends and the figures of its tcp_info line
that say how a transfer went: congestion control, window and RTT, bytes sent, acknowledged, received
and retransmitted, retransmitted segments, the receive window the peer advertises (`snd_wnd`) and this
end's receive-buffer estimate (`rcv_space`), and the time the sender was limited by the receiver's
window, its own send buffer, or nothing (busy). Counters run from the connection's start.
"""

from __future__ import annotations

import re
from typing import Any

ADDRESS = re.compile(r"^\[?[0-9a-fA-F.:]+\]?(%\S+)?:\d+$")
NUMBERS = {
    "cwnd": "cwnd", "ssthresh": "ssthresh", "bytes_sent": "bytes_sent", "bytes_acked": "bytes_acked",
    "bytes_received": "bytes_received", "bytes_retrans": "bytes_retrans", "data_segs_out": "data_segs_out",
    "data_segs_in": "data_segs_in", "snd_wnd": "snd_wnd", "rcv_space": "rcv_space", "rcv_ssthresh": "rcv_ssthresh",
    "lost": "lost", "notsent": "notsent", "unacked": "unacked", "mss": "mss",
}
COUNTERS = ("bytes_sent", "bytes_acked", "bytes_received", "bytes_retrans", "data_segs_out", "data_segs_in",
            "retrans", "rwnd_limited_ms", "sndbuf_limited_ms", "busy_ms")
"""Figures that only grow over a connection's life: a run's share is the difference."""


def parse_ss(text: str) -> list[dict[str, Any]]:
    """Connections of `ss -tinH` output (with or without its State column)."""
    conns: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace():
            ends = [word for word in line.split() if ADDRESS.match(word)]
            current = {"local": ends[-2], "peer": ends[-1]} if len(ends) >= 2 else None
            if current is not None:
                conns.append(current)
        elif current is not None:
            current.update(parse_info(line))
    return conns


def parse_info(line: str) -> dict[str, Any]:
    """The figures of one tcp_info line."""
    out: dict[str, Any] = {}
    words = line.split()
    if words and ":" not in words[0] and not words[0][0].isdigit():
        out["cc"] = words[0]
    for i, word in enumerate(words):
        key, sep, value = word.partition(":")
        if not sep:
            if word == "delivery_rate" and i + 1 < len(words):
                out["delivery_rate_bps"] = _bps(words[i + 1])
            continue
        if key in NUMBERS:
            out[NUMBERS[key]] = _number(value)
        elif key == "rtt":
            out["rtt_ms"] = _number(value.partition("/")[0])
        elif key == "minrtt":
            out["minrtt_ms"] = _number(value)
        elif key == "retrans":  # unrecovered now / in all
            out["retrans"] = _number(value.partition("/")[2])
        elif key in ("rwnd_limited", "sndbuf_limited", "busy"):
            out[f"{key}_ms"] = _number(value.partition("ms")[0])
    return out


def _number(text: str) -> float | int:
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return 0


def _bps(text: str) -> float:
    scale = {"Kbps": 1e3, "Mbps": 1e6, "Gbps": 1e9, "bps": 1.0}
    for unit, factor in scale.items():
        if text.endswith(unit):
            return float(_number(text[: -len(unit)])) * factor
    return float(_number(text))
