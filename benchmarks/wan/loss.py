"""Loss on an emulated link direction: random drops at a rate, and bursts (a Gilbert model: a burst
starts at `burst_rate` per packet and drops `burst_len` packets in a row on average). `Loss` is what a
link is asked for (`Wan.link(..., loss=)`, `Link.set_loss`); `Dropper` is what the delayer of that
direction (delayer.py, which imports this file as a plain module) decides with.

Rates are per wire packet (segment). A delayer sees TCP's GSO packets whole (several segments each,
as TCP handed them to the link), so it runs the model once per segment a packet carries and drops the
packet when any of its segments is lost: loss events come at the rate asked, and each costs the
segments that TCP sent together (`segments_of`; on a link made with `wire_packets=True` every packet
is one segment, and a drop loses exactly one).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any

TCP_HEADERS = 52
"""IPv4 and TCP headers with timestamps: what a GSO packet carries once for all its segments."""
MSS = 1448
"""Payload of one segment at MTU 1500 with TCP timestamps."""


def segments_of(length: int) -> int:
    """Wire packets a packet of `length` bytes (IP header on) stands for: one, or a GSO packet's segments."""
    return max(1, -(-(length - TCP_HEADERS) // MSS))


@dataclass(frozen=True)
class Loss:
    """Random drops at `rate`, plus bursts starting at `burst_rate` per packet, each `burst_len`
    packets long on average (geometric); the expected share of packets lost is `expected`."""

    rate: float = 0.0
    burst_rate: float = 0.0
    burst_len: float = 1.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.rate < 1.0 and 0.0 <= self.burst_rate < 1.0 and self.burst_len >= 1.0):
            raise ValueError(f"bad loss {self}: rates must be in [0, 1) and a burst at least 1 packet long")

    @property
    def active(self) -> bool:
        return self.rate > 0 or self.burst_rate > 0

    @property
    def expected(self) -> float:
        """The share of packets this loses in the long run."""
        bursts = self.burst_rate * self.burst_len
        return self.rate + bursts - self.rate * bursts

    def as_dict(self) -> dict[str, float]:
        return asdict(self)

    @classmethod
    def of(cls, value: Any) -> Loss:
        """A Loss from a Loss, a plain rate (float), a mapping of its fields, or None (no loss)."""
        if value is None:
            return cls()
        if isinstance(value, Loss):
            return value
        if isinstance(value, dict):
            return cls(**value)
        return cls(rate=float(value))

    def describe(self) -> str:
        parts = [f"{self.rate:.2%} random"] if self.rate else []
        if self.burst_rate:
            parts.append(f"bursts of {self.burst_len:g} at {self.burst_rate:.3%}")
        return " + ".join(parts) or "none"


class Dropper:
    """Decides, packet by packet, which packets a lossy link direction loses."""

    def __init__(self, loss: Loss, rng: random.Random):
        self.loss = loss
        self.random = rng.random
        self.in_burst = False

    def drop(self, segments: int = 1) -> bool:
        """Whether a packet of `segments` segments is lost (any of them is)."""
        lost = False
        for _ in range(segments):
            lost = self._segment() or lost
        return lost

    def _segment(self) -> bool:
        if self.in_burst:
            # After each packet of a burst, it ends with probability 1/len: a mean of `burst_len`.
            self.in_burst = self.random() >= 1.0 / self.loss.burst_len
            return True
        if self.loss.burst_rate and self.random() < self.loss.burst_rate:
            self.in_burst = self.random() >= 1.0 / self.loss.burst_len
            return True
        return self.random() < self.loss.rate
