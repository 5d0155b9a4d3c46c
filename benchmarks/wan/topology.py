"""Describing an emulated network in TOML and building it on a `Wan`.

    hosts = ["spare"]          # optional: hosts with no link yet
    [[link]]
    a = "origin"
    b = "regionA"
    mbit = 400                 # a -> b
    rtt_ms = 300
    mbit_back = 100            # optional, b -> a (default: mbit)
    queue_ms = 300             # optional, sender queue (default: one RTT, at least 20 ms)
    loss = 0.001               # optional, random loss each way (the link is lossy: Link.set_loss)

Hosts are created in the order they are first named. Loaded with the project's config loader,
so an unknown key or a wrong type is an error, not a silently ignored setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from deltamesh.config import load_config

from .emulator import Wan


@dataclass
class LinkSpec:
    a: str
    b: str
    mbit: float
    rtt_ms: float
    mbit_back: float | None = None
    queue_ms: float | None = None
    loss: float | None = None

    def __post_init__(self) -> None:
        if self.a == self.b:
            raise ValueError(f"link {self.a}-{self.b} joins a host to itself")
        if self.mbit <= 0 or (self.mbit_back is not None and self.mbit_back <= 0):
            raise ValueError(f"link {self.a}-{self.b}: rates must be positive")
        if self.rtt_ms < 0 or (self.queue_ms is not None and self.queue_ms <= 0):
            raise ValueError(f"link {self.a}-{self.b}: rtt_ms must be >= 0 and queue_ms > 0")
        if self.loss is not None and not 0 <= self.loss < 1:
            raise ValueError(f"link {self.a}-{self.b}: loss must be in [0, 1)")


@dataclass
class Topology:
    hosts: list[str] = field(default_factory=list)
    link: list[LinkSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        pairs = [frozenset((spec.a, spec.b)) for spec in self.link]
        if len(pairs) != len(set(pairs)):
            raise ValueError("two links join the same pair of hosts")

    def host_names(self) -> list[str]:
        names = list(self.hosts) + [name for spec in self.link for name in (spec.a, spec.b)]
        return list(dict.fromkeys(names))


def load_topology(path: str | Path) -> Topology:
    return load_config(Topology, path)


def build(wan: Wan, topology: Topology) -> None:
    """Create the topology's hosts and links on `wan`."""
    for name in topology.host_names():
        wan.host(name)
    for spec in topology.link:
        wan.link(wan.hosts[spec.a], wan.hosts[spec.b], mbit=spec.mbit, rtt_ms=spec.rtt_ms,
                 mbit_back=spec.mbit_back, queue_ms=spec.queue_ms, loss=spec.loss)
