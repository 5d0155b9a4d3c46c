"""The single-stream baseline's time when its download was capped (`get --cap-s`, see
transfer_agent_baselines.py): one TCP stream over a long link can take minutes, and several on a lossy
one, so the benchmark measures it for a fixed window and extrapolates. The rate is the one over the
second half of the window (past slow start and the receive window's growth, as far as they got), the
time is the window plus what had not arrived at that rate. Every figure so made says so
(`extrapolated`), with the window and the bytes it was taken from.
"""

from __future__ import annotations

from typing import Any

MIN_RATE_BPS = 1.0
"""A window in whose second half nothing arrived is extrapolated at this rate (bytes/s): a time that
large says that the stream had stalled, without dividing by zero."""


def baseline_seconds(result: dict[str, Any], t_start: float) -> tuple[float, dict[str, Any]]:
    """(seconds, how they were had) of one download from `t_start`: measured when it ended inside its
    window, else extrapolated from the window's second half."""
    if not result.get("capped"):
        return result["t_done"] - t_start, {"extrapolated": False}
    window = result["t_done"] - result["t_go"]
    marks = [(t, n) for t, n in result.get("marks") or [] if t <= window]
    received, total = result["bytes"], result["total"]
    half = [(t, n) for t, n in marks if t >= window / 2]
    if half and window - half[0][0] > 0:
        rate = max(MIN_RATE_BPS, (received - half[0][1]) / (window - half[0][0]))
    else:
        rate = max(MIN_RATE_BPS, received / window) if window > 0 else MIN_RATE_BPS
    seconds = (result["t_go"] - t_start) + window + (total - received) / rate
    return seconds, {"extrapolated": True, "window_s": round(window, 2), "received_bytes": received,
                     "rate_mbit": round(rate * 8 / 1e6, 2)}
