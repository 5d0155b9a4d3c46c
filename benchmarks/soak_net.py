"""The soak's network: three regions as namespaces of the WAN emulator, and the link faults it injects.

`core` holds the origin gateway, the brokers, PostgreSQL, the trainer, one pool and the soak itself
(`enter` moves the calling thread there, so everything the soak starts afterwards runs inside); `eu`
and `ap` hold a relay gateway and their pools each. The origin relays to eu over one link, eu relays
to ap over another, and a third joins core and ap directly (ap's pools reach the brokers over it).
Every service listens on its host's own address (`host.ip`), routed from the neighbours.

The link faults go through the emulator's public pieces and leave its delayers alone: a cut drops
everything that arrives on the link's two ends (an iptables rule inserted before the delay rule), a
lossy link drops a random share of it (iptables' `statistic` match; the emulator's own loss knob, when
it has one, does the same), and a trickle replaces the link's rate limit (`shaping.limit_rate`) with a
tiny one. Each is undone by removing exactly the rule it added, or by restoring the link's rate.
"""

from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

from wan import Host, Link, Wan
from wan.shaping import limit_rate
from wan.shell import in_netns, run

log = logging.getLogger(__name__)

CLONE_NEWNET = 0x40000000


@dataclass(frozen=True)
class LinkPlan:
    a: str
    b: str
    mbit: float
    rtt_ms: float

    @property
    def name(self) -> str:
        return f"{self.a}-{self.b}"


HOSTS = ("core", "eu", "ap")
LINKS = (LinkPlan("core", "eu", 100, 40), LinkPlan("eu", "ap", 50, 80), LinkPlan("core", "ap", 50, 120))


class SoakNet:
    """The emulated network of one soak run (torn down by `close`)."""

    def __init__(self) -> None:
        self.wan = Wan("soak")
        self.hosts: dict[str, Host] = {}
        self.links: dict[str, Link] = {}
        self._rules: dict[str, list[tuple[str, list[str]]]] = {}  # link -> (namespace, iptables rule)
        self._home: int | None = None  # the network namespace the soak came from, while it is away

    def build(self) -> None:
        for name in HOSTS:
            self.hosts[name] = self.wan.host(name)
        for plan in LINKS:
            self.links[plan.name] = self.wan.link(self.hosts[plan.a], self.hosts[plan.b], mbit=plan.mbit,
                                                  rtt_ms=plan.rtt_ms)

    def ip(self, host: str) -> str:
        return self.hosts[host].ip

    def netns_prefix(self, host: str) -> list[str]:
        """The command prefix that runs a program inside `host`."""
        return in_netns(self.hosts[host].namespace, [])

    def enter(self, host: str) -> None:
        """Move the calling thread (and everything it starts later) into `host`'s network namespace."""
        if self._home is None:
            self._home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        fd = os.open(f"/run/netns/{self.hosts[host].namespace}", os.O_RDONLY)
        try:
            _setns(fd, host)
        finally:
            os.close(fd)

    def leave(self) -> None:
        """Back to the namespace the calling thread came from (before the teardown ends what is inside)."""
        if self._home is not None:
            _setns(self._home, "the soak's own namespace")
            os.close(self._home)
            self._home = None

    # -- link faults -----------------------------------------------------------------------------
    def cut(self, link: str) -> None:
        self._drop(link, [])

    def lose(self, link: str, probability: float) -> None:
        self._drop(link, ["-m", "statistic", "--mode", "random", "--probability", f"{probability:.4f}"])

    def heal_drops(self, link: str) -> None:
        """Remove the rules a cut or a loss added on `link`."""
        for namespace, rule in self._rules.pop(link, []):
            run(in_netns(namespace, ["iptables", "-w", "-D", "INPUT", *rule]), check=False)

    def trickle(self, link: str, mbit: float) -> None:
        k = self.links[link]
        for me, peer in ((k.a, k.b), (k.b, k.a)):
            limit_rate(me.namespace, me.iface_to(peer), mbit, k.queue_ms)

    def restore_rate(self, link: str) -> None:
        k = self.links[link]
        for me, peer in ((k.a, k.b), (k.b, k.a)):
            limit_rate(me.namespace, me.iface_to(peer), k.mbit_from(me), k.queue_ms)

    def _drop(self, link: str, match: list[str]) -> None:
        k = self.links[link]
        for me, peer in ((k.a, k.b), (k.b, k.a)):
            rule = ["-i", me.iface_to(peer), *match, "-j", "DROP"]
            run(in_netns(me.namespace, ["iptables", "-w", "-I", "INPUT", "1", *rule]))
            self._rules.setdefault(link, []).append((me.namespace, rule))

    def close(self) -> None:
        self.leave()
        self.wan.close()


def _setns(fd: int, what: str) -> None:
    if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns into {what}: {os.strerror(err)}")
