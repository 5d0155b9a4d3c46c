"""The parts of an emulated network (emulator.py's `Wan` makes them): `Host`, a network namespace
that processes run in; `Link`, a point-to-point link between two hosts with its rate, delay and loss
each way; and `DelayLine`, the delayer of one direction of a link, whose counts say what that
direction did (records.py) and whose loss can change while it runs (`Link.set_loss`).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .loss import Loss
from .shaping import delayer_files, write_loss
from .shell import WanError, in_netns

if TYPE_CHECKING:
    from .emulator import Wan


@dataclass(eq=False)
class Host:
    """One emulated region or pool: a network namespace."""

    wan: Wan = field(repr=False)
    name: str
    index: int
    namespace: str
    ip: str
    links: dict[str, Link] = field(default_factory=dict, repr=False)
    next_queue: int = field(default=0, repr=False)

    def link_to(self, peer: Host) -> Link:
        """The link between this host and `peer` (WanError if there is none)."""
        try:
            return self.links[peer.name]
        except KeyError:
            raise WanError(f"{self.name} and {peer.name} share no link") from None

    def addr_of(self, peer: Host) -> str:
        """The address this host reaches `peer` at: the peer's end of their link."""
        return self.link_to(peer).addr(peer)

    def iface_to(self, peer: Host) -> str:
        return f"to-{peer.name}"

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` as a command line that runs inside this host's namespace."""
        return in_netns(self.namespace, [str(a) for a in argv])

    def spawn(self, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen:
        """Start `argv` inside this host, in its own session; it is ended at teardown."""
        return self.wan._spawn(self, argv, popen_kwargs)

    def run(self, argv: Sequence[str], *, timeout: float = 120.0, check: bool = True) -> subprocess.CompletedProcess:
        """Run `argv` inside this host to completion (text output captured)."""
        try:
            done = subprocess.run(self.command(argv), capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise WanError(f"{self.name}: {' '.join(map(str, argv))} ran past {timeout:g} s") from None
        if check and done.returncode != 0:
            raise WanError(f"{self.name}: {' '.join(map(str, argv))} exited {done.returncode}: {done.stderr.strip()}")
        return done


@dataclass(eq=False)
class DelayLine:
    """The delayer of one direction of a link: it runs in the receiving host, on its end of the link."""

    sender: Host = field(repr=False)
    receiver: Host = field(repr=False)
    iface: str
    """The receiver's end of the link, where the packets arrive."""
    log_path: Path
    proc: subprocess.Popen | None = field(default=None, repr=False)
    """None in a view of a detached network (`Wan.attach`)."""

    @property
    def stats_path(self) -> Path:
        """Where the delayer writes its counts on SIGUSR1 (records.py)."""
        return delayer_files(self.log_path)[0]

    @property
    def control_path(self) -> Path:
        """The loss the delayer reads on SIGUSR2."""
        return delayer_files(self.log_path)[1]

    @property
    def name(self) -> str:
        return f"{self.sender.name} -> {self.receiver.name}"


@dataclass(eq=False)
class Link:
    """A point-to-point link; `mbit_ab` is the rate from `a` to `b`, the delay is `rtt_ms / 2` each way,
    `loss_ab` what a->b loses (`lossy`: created able to lose packets)."""

    index: int
    a: Host
    b: Host
    addr_a: str
    addr_b: str
    mbit_ab: float
    mbit_ba: float
    rtt_ms: float
    queue_ms: float
    delayers: list[subprocess.Popen] = field(default_factory=list, repr=False)
    loss_ab: Loss = field(default_factory=Loss)
    loss_ba: Loss = field(default_factory=Loss)
    lossy: bool = False
    wire_packets: bool = False
    """Every packet one segment (no GSO): a drop loses exactly one wire packet."""
    lines: dict[str, DelayLine] = field(default_factory=dict, repr=False)
    """The delay line of each direction, by its sender's name."""

    def addr(self, host: Host) -> str:
        """The address of `host`'s end of this link."""
        if host is self.a:
            return self.addr_a
        if host is self.b:
            return self.addr_b
        raise WanError(f"{host.name} is not on the link {self.a.name}-{self.b.name}")

    def mbit_from(self, sender: Host) -> float:
        """The rate of the direction that `sender` sends on."""
        return self.mbit_ab if sender is self.a else self.mbit_ba

    def loss_from(self, sender: Host) -> Loss:
        """What the direction that `sender` sends on loses."""
        return self.loss_ab if sender is self.a else self.loss_ba

    def line_from(self, sender: Host) -> DelayLine | None:
        """The delay line of the direction `sender` sends on (None: a link without delay or loss)."""
        return self.lines.get(sender.name)

    def set_loss(self, sender: Host, loss: Loss | float | None) -> None:
        """Change what the direction `sender` sends on loses, at once, on the running link (its
        delayer reads it on SIGUSR2). Only a link made with `loss=` (even 0) can lose packets: a
        link without a delayer (no delay, no loss) has nothing that could drop them."""
        loss = Loss.of(loss)
        line = self.line_from(sender)
        if not self.lossy or line is None:
            raise WanError(f"link {self.a.name}-{self.b.name} was not made lossy (Wan.link(..., loss=...))")
        write_loss(line.control_path, loss)
        if line.proc is not None:
            line.proc.send_signal(signal.SIGUSR2)
        else:  # a view of a detached network: the delayer's pid is in its counts
            os.kill(json.loads(line.stats_path.read_text())["pid"], signal.SIGUSR2)
        if sender is self.a:
            self.loss_ab = loss
        else:
            self.loss_ba = loss

    def dead_delayers(self) -> list[str]:
        """Delayers of this link that have exited (its traffic in that direction is dropped)."""
        return [" ".join(map(str, p.args[-5:])) for p in self.delayers if p.poll() is not None]
