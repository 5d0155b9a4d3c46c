"""The emulated network itself (`Wan`, `Host`, `Link`): hosts are network namespaces joined by
point-to-point veth links, each direction shaped on its own (see shaping.py), with the
processes run inside them; everything made is registered and removed by `close()`, which
`__exit__`, an `atexit` hook and, inside `with` on the main thread, SIGINT/SIGTERM all reach.
Addressing, isolation and teardown guarantees are described in this folder's README.md.
"""

from __future__ import annotations

import atexit
import json
import logging
import re
import secrets
import shutil
import signal
import subprocess
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import netns
from .links import DelayLine, Host, Link
from .loss import Loss
from .processes import stop_processes
from .shaping import limit_rate, one_segment_per_packet, start_delayer
from .shell import WanError, run

log = logging.getLogger(__name__)

STATE_DIR = Path("/run/deltamesh-wan")
# An interface name is at most 15 bytes and is "to-" + the peer's name.
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,11}$")
PREFIX = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,23}$")
MAX_LINKS = 64 * 256
MAX_HOSTS = 256 * 256 - 1


class Wan:
    """An emulated wide-area network; use it as a context manager so it is always torn down.

    `name_prefix` starts every namespace name; unless `unique=False` a random suffix is added
    so concurrent runs never collide (the full prefix is `wan.prefix`).
    """

    def __init__(self, name_prefix: str = "wan", *, unique: bool = True) -> None:
        self._start(_free_prefix(name_prefix, unique), owned=True)

    def _start(self, prefix: str, owned: bool) -> None:
        self.prefix = prefix
        self.hosts: dict[str, Host] = {}
        self.links: list[Link] = []
        self._delayers: list[subprocess.Popen] = []
        self._spawned: list[subprocess.Popen] = []
        self._owned = owned
        self._closed = False
        self._saved_handlers: dict[int, Any] = {}
        self._lock = threading.Lock()
        atexit.register(self.close)

    # --- building -------------------------------------------------------------------------

    def host(self, name: str) -> Host:
        """The host called `name`, created (as a namespace) on first use."""
        if name in self.hosts:
            return self.hosts[name]
        if not HOST_NAME.match(name):
            raise WanError(f"bad host name {name!r}: up to 12 letters, digits, _ or -")
        if len(self.hosts) >= MAX_HOSTS:
            raise WanError(f"at most {MAX_HOSTS} hosts")
        self._check_open()
        index = len(self.hosts) + 1
        host = Host(self, name, index, f"{self.prefix}-{name}", f"10.78.{index >> 8}.{index & 255}")
        netns.create(host.namespace)
        self.hosts[name] = host
        run(["ip", "-n", host.namespace, "addr", "add", f"{host.ip}/32", "dev", "lo"])
        return host

    def link(self, a: Host, b: Host, *, mbit: float, rtt_ms: float,
             mbit_back: float | None = None, queue_ms: float | None = None,
             loss: Loss | float | None = None, loss_back: Loss | float | None = None,
             wire_packets: bool = False) -> Link:
        """Join `a` and `b`: `mbit` from a to b (`mbit_back` from b to a, default the same),
        `rtt_ms / 2` of delay each way, and a sender queue of `queue_ms` (default: one RTT,
        at least 20 ms) of traffic at the link's rate. With `loss` (a `Loss`, or a random drop
        rate) a to b loses packets, and b to a too (`loss_back`, default the same), and can change
        its loss later (`Link.set_loss`), even to none; without it, it never loses a packet but to
        its queues. `wire_packets` sends one segment per packet both ways (no GSO): exact per-packet
        loss, at a per-packet cost the delayers cannot keep up with at hundreds of Mbit/s here."""
        self._check_open()
        if a is b or b.name in a.links:
            raise WanError(f"cannot link {a.name} to {b.name}: same host or already linked")
        mbit_back = mbit if mbit_back is None else mbit_back
        if min(mbit, mbit_back) <= 0 or rtt_ms < 0:
            raise WanError("a link needs a positive rate and a non-negative RTT")
        if len(self.links) >= MAX_LINKS:
            raise WanError(f"at most {MAX_LINKS} links")
        index = len(self.links)
        subnet = f"10.77.{index >> 6}.{(index & 63) << 2}"  # a /30: .1 is a's end, .2 is b's
        stem, _, base = subnet.rpartition(".")
        lossy = loss is not None or loss_back is not None
        link = Link(index, a, b, f"{stem}.{int(base) + 1}", f"{stem}.{int(base) + 2}", mbit, mbit_back,
                    rtt_ms, max(20.0, rtt_ms) if queue_ms is None else queue_ms,
                    loss_ab=Loss.of(loss), loss_ba=Loss.of(loss if loss_back is None else loss_back), lossy=lossy,
                    wire_packets=wire_packets)
        run(["ip", "link", "add", a.iface_to(b), "netns", a.namespace, "type", "veth",
             "peer", "name", b.iface_to(a), "netns", b.namespace])
        a.links[b.name], b.links[a.name] = link, link
        self.links.append(link)
        for me, peer in ((a, b), (b, a)):
            iface = me.iface_to(peer)
            run(["ip", "-n", me.namespace, "addr", "add", f"{link.addr(me)}/30", "dev", iface])
            run(["ip", "-n", me.namespace, "link", "set", iface, "up"])
            run(["ip", "-n", me.namespace, "route", "add", f"{peer.ip}/32", "dev", iface])
            limit_rate(me.namespace, iface, link.mbit_from(me), link.queue_ms)
            if wire_packets:
                one_segment_per_packet(me.namespace, iface)
            if rtt_ms > 0 or lossy:  # `me` receives what `peer` sends: the delay line of peer -> me
                queue, me.next_queue = me.next_queue, me.next_queue + 1
                log_path = self.log_dir() / f"delayer-{me.name}-{iface}.log"
                delayer = start_delayer(me.namespace, iface, queue, rtt_ms / 2, log_path,
                                        loss=link.loss_from(peer), lossy=lossy)
                self._delayers.append(delayer)
                link.delayers.append(delayer)
                link.lines[peer.name] = DelayLine(peer, me, iface, log_path, delayer)
        log.info("link %s <-> %s: %s/%s Mbit/s, RTT %s ms, loss %s / %s", a.name, b.name, mbit, mbit_back, rtt_ms,
                 link.loss_ab.describe(), link.loss_ba.describe())
        return link

    def log_dir(self) -> Path:
        """Where this network's delayers write their stderr (removed with the network)."""
        path = STATE_DIR / self.prefix
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _spawn(self, host: Host, argv: Sequence[str], popen_kwargs: dict[str, Any]) -> subprocess.Popen:
        self._check_open()
        popen_kwargs.setdefault("stdin", subprocess.DEVNULL)
        proc = subprocess.Popen(host.command(argv), start_new_session=True, **popen_kwargs)
        self._spawned.append(proc)
        return proc

    def _check_open(self) -> None:
        if self._closed:
            raise WanError(f"WAN {self.prefix} is already torn down")

    # --- checking -------------------------------------------------------------------------

    @property
    def delayers(self) -> tuple[subprocess.Popen, ...]:
        """The delayer processes; per link, first the one in `a` (delaying b->a), then the one in `b`."""
        return tuple(self._delayers)

    def dead_delayers(self) -> list[str]:
        """Command lines of delayers that have exited (a link without its delay drops everything)."""
        return [text for link in self.links for text in link.dead_delayers()]

    def verify_link(self, a: Host, b: Host, **options: Any):
        """Measure RTT and a->b throughput; see verify.verify_link for the options."""
        from .verify import verify_link

        return verify_link(a, b, **options)

    # --- describing and re-attaching ------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """A JSON-able description: hosts (namespace, ip) and links (ends, addresses, shaping)."""
        return {
            "prefix": self.prefix,
            "hosts": [{"name": h.name, "namespace": h.namespace, "ip": h.ip} for h in self.hosts.values()],
            "links": [{"a": k.a.name, "b": k.b.name, "addr_a": k.addr_a, "addr_b": k.addr_b,
                       "mbit_ab": k.mbit_ab, "mbit_ba": k.mbit_ba, "rtt_ms": k.rtt_ms,
                       "queue_ms": k.queue_ms, "loss_ab": k.loss_ab.as_dict(), "loss_ba": k.loss_ba.as_dict(),
                       "lossy": k.lossy, "wire_packets": k.wire_packets,
                       "lines": {sender: line.log_path.name for sender, line in k.lines.items()}}
                      for k in self.links],
        }

    def save_state(self) -> Path:
        """Write the state file that `Wan.attach(prefix)` (and so `cli.py verify`) reads."""
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        path = STATE_DIR / f"{self.prefix}.json"
        path.write_text(json.dumps(self.state(), indent=1))
        return path

    def detach(self) -> Path:
        """Leave the network running after this object goes away; return its state file.

        `Wan.attach(prefix)` reads it back; `cli.py down`/`cleanup` remove network and file.
        """
        path = self.save_state()
        self._owned = False
        self._delayers.clear()
        for link in self.links:
            link.delayers.clear()
            for line in link.lines.values():
                line.proc = None
        return path

    @classmethod
    def attach(cls, prefix: str) -> Wan:
        """A view of a detached network; closing it ends only what it spawned itself."""
        try:
            state = json.loads((STATE_DIR / f"{prefix}.json").read_text())
        except FileNotFoundError:
            raise WanError(f"no emulated network {prefix!r} is up (no state file)") from None
        wan = cls.__new__(cls)
        wan._start(prefix, owned=False)
        for item in state["hosts"]:
            host = Host(wan, item["name"], len(wan.hosts) + 1, item["namespace"], item["ip"])
            wan.hosts[host.name] = host
        for index, item in enumerate(state["links"]):
            a, b = wan.hosts[item["a"]], wan.hosts[item["b"]]
            link = Link(index, a, b, item["addr_a"], item["addr_b"], item["mbit_ab"], item["mbit_ba"],
                        item["rtt_ms"], item["queue_ms"], loss_ab=Loss.of(item.get("loss_ab")),
                        loss_ba=Loss.of(item.get("loss_ba")), lossy=item.get("lossy", False),
                        wire_packets=item.get("wire_packets", False))
            for sender, log_name in item.get("lines", {}).items():
                receiver = b if sender == a.name else a
                link.lines[sender] = DelayLine(wan.hosts[sender], receiver, receiver.iface_to(wan.hosts[sender]),
                                               wan.log_dir() / log_name)
            a.links[b.name], b.links[a.name] = link, link
            wan.links.append(link)
        return wan

    # --- teardown -------------------------------------------------------------------------

    def __enter__(self) -> Wan:
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self._saved_handlers[signum] = signal.signal(signum, _raise_on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        try:
            self.close()
        finally:
            for signum, handler in self._saved_handlers.items():
                signal.signal(signum, handler)
            self._saved_handlers.clear()

    def close(self) -> None:
        """Tear everything down (idempotent): processes, then namespaces with their links and rules."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        with _signals_held():
            _quietly(stop_processes, self._spawned + self._delayers)
            if self._owned:
                # By prefix rather than from self.hosts, so that a namespace a signal cut off
                # between its creation and its registration goes too.
                _quietly(netns.purge, f"{self.prefix}-")
                _quietly(remove_state, self.prefix)
        atexit.unregister(self.close)
        if self._owned:
            log.info("WAN %s torn down", self.prefix)


def _free_prefix(name_prefix: str, unique: bool) -> str:
    """A prefix no existing namespace uses: so teardown, which goes by prefix, removes only ours."""
    prefix = name_prefix + secrets.token_hex(2) if unique else name_prefix
    if not PREFIX.match(prefix):
        raise WanError(f"bad prefix {prefix!r}: a letter, then up to 23 letters, digits or _")
    while netns.list_namespaces(f"{prefix}-"):
        if not unique:
            raise WanError(f"namespaces {prefix}-* exist already (remove them with cleanup --prefix {prefix})")
        prefix = name_prefix + secrets.token_hex(2)
    return prefix


def remove_state(prefix: str) -> None:
    """Delete a network's state file and delayer logs."""
    (STATE_DIR / f"{prefix}.json").unlink(missing_ok=True)
    shutil.rmtree(STATE_DIR / prefix, ignore_errors=True)


def _raise_on_signal(signum: int, _frame: object) -> None:
    # Raising unwinds the `with` block, whose __exit__ then tears the network down.
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


class _signals_held:
    """Ignore SIGINT/SIGTERM while tearing down, so a second Ctrl-C cannot leave a half-removed network."""

    def __enter__(self) -> None:
        self.saved: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGINT, signal.SIGTERM):
                self.saved[signum] = signal.signal(signum, signal.SIG_IGN)

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self.saved.items():
            signal.signal(signum, handler)


def _quietly(step: Any, *args: Any) -> None:
    """Run one teardown step; log a failure and go on, so one stuck step does not strand the rest."""
    try:
        step(*args)
    except Exception:
        log.exception("teardown step %s%s failed", step.__name__, args)
