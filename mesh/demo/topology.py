"""A mesh topology: the regions' gateways (who relays from whom, over what link) and the pools in each region.

The `[topology]` table of a TOML file, loaded with the project's config loader:

    [[topology.gateways]]
    region = "us-east"            # the first gateway without an upstream is the origin
    [[topology.gateways]]
    region = "eu-west"
    upstream = "us-east"          # relays from this region's gateway
    bandwidth_mbps = 100          # cap on the upstream link (0: none)
    delay_ms = 40                 # latency added to each request over it (0: none)
    [[topology.pools]]
    name = "eu-1"
    region = "eu-west"

A gateway's upstream must be listed before it, so the list is also a start order and has no cycles.
The link cap and delay are applied by the downstream gateway itself (`bandwidth_cap_mbps`,
`link_delay_ms`): distance emulated in the application, so a topology runs on one machine without
network namespaces. `DEFAULT_TOPOLOGY` is the three-region mesh `deltamesh demo` runs.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from deltamesh.config import from_dict, load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")

DEFAULT_TOPOLOGY = """
[[topology.gateways]]
region = "us-east"

[[topology.gateways]]
region = "eu-west"
upstream = "us-east"
bandwidth_mbps = 100
delay_ms = 40

[[topology.gateways]]
region = "ap-south"
upstream = "eu-west"
bandwidth_mbps = 50
delay_ms = 80

[[topology.pools]]
name = "us-1"
region = "us-east"

[[topology.pools]]
name = "eu-1"
region = "eu-west"

[[topology.pools]]
name = "ap-1"
region = "ap-south"
"""


@dataclass
class GatewaySpec:
    """One region's gateway and the link to its upstream (none for the origin)."""

    region: str
    upstream: str = ""
    bandwidth_mbps: float = 0.0
    delay_ms: float = 0.0

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.region):
            raise ValueError(f"region {self.region!r} must match {NAME_RE.pattern}")
        if self.bandwidth_mbps < 0 or self.delay_ms < 0:
            raise ValueError(f"region {self.region}: bandwidth_mbps and delay_ms must be >= 0")
        if not self.upstream and (self.bandwidth_mbps or self.delay_ms):
            raise ValueError(f"region {self.region} has no upstream, so no link to cap or delay")

    @property
    def link(self) -> str:
        """The name of the link into this region ("upstream->region"), empty for the origin."""
        return f"{self.upstream}->{self.region}" if self.upstream else ""


@dataclass
class PoolSpec:
    """A rollout pool and the region whose gateway it follows."""

    name: str
    region: str

    def __post_init__(self) -> None:
        if not NAME_RE.match(self.name):
            raise ValueError(f"pool name {self.name!r} must match {NAME_RE.pattern}")


@dataclass
class Topology:
    gateways: list[GatewaySpec] = field(default_factory=list)
    pools: list[PoolSpec] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.gateways:
            raise ValueError("a topology needs at least one gateway")
        if self.gateways[0].upstream:
            raise ValueError("the first gateway must be the origin (no upstream)")
        seen: set[str] = set()
        for g in self.gateways:
            if g.region in seen:
                raise ValueError(f"region {g.region} is listed twice")
            if g.upstream and g.upstream not in seen:
                raise ValueError(f"region {g.region}: upstream {g.upstream!r} must be listed before it")
            if g is not self.gateways[0] and not g.upstream:
                raise ValueError(f"region {g.region}: only the first gateway may be an origin")
            seen.add(g.region)
        names = [p.name for p in self.pools]
        if len(set(names)) != len(names):
            raise ValueError(f"pool names must be distinct, got {names}")
        for p in self.pools:
            if p.region not in seen:
                raise ValueError(f"pool {p.name}: unknown region {p.region!r}")

    @property
    def origin(self) -> GatewaySpec:
        return self.gateways[0]

    def gateway(self, region: str) -> GatewaySpec:
        for g in self.gateways:
            if g.region == region:
                return g
        raise KeyError(region)

    def relays(self) -> list[GatewaySpec]:
        """The gateways with an upstream, in start order: one per inter-region link."""
        return [g for g in self.gateways if g.upstream]

    def hops(self, region: str) -> int:
        """Links between the origin and `region`."""
        n, g = 0, self.gateway(region)
        while g.upstream:
            n, g = n + 1, self.gateway(g.upstream)
        return n

    def with_pools(self, count: int) -> "Topology":
        """The same gateways with only the first `count` pools."""
        if not 1 <= count <= len(self.pools):
            raise ValueError(f"the topology has {len(self.pools)} pools; asked for {count}")
        return Topology(list(self.gateways), list(self.pools[:count]))


def default_topology() -> Topology:
    return from_dict(Topology, tomllib.loads(DEFAULT_TOPOLOGY)["topology"], where="topology")


def load_topology(path: str | Path) -> Topology:
    """The `[topology]` table of a TOML file (errors name the bad key)."""
    return load_config(Topology, path, section="topology")
