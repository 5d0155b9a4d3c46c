"""Running the transfer scenarios' processes on an emulated network: gateways, agents, counters, routes.

`Mesh` wraps one `wan.Wan` with what every scenario needs: a working folder and trainer key, real
`deltamesh gateway` processes in hosts (over HTTPS with a CA made for the run where asked, see
transfer_tls.py), timed agents (transfer_agent.py) started together through ready/go files, the bytes
a gateway or file server has sent, and the bytes that left a host's links.
`route_through` lets a host reach a far host through a middle one by plain IP forwarding, with the
middle host's link delays still applied to forwarded packets (the AstraFlow baseline's pools reach
the trainer node that way). `set_tcp_buffers` chooses the hosts' TCP buffer limits and congestion
control (`congestion_allowed` lets namespaces use one the machine does not allow them by default).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from transfer_protocol import end_file
from transfer_tls import RunPki
from wan import Host, Wan, WanError

from deltamesh.delta import generate_key, save_keypair
from deltamesh.mesh.demo.processes import log_tail

log = logging.getLogger(__name__)

AGENT = Path(__file__).resolve().with_name("transfer_agent.py")
DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))
GATEWAY_PORT = 8600
FILE_PORT = 8700
POOL_TOKEN = "bench-pool-token"

# TCP buffer limits (min, default, max bytes) of every emulated host. "linux": the long-standing
# kernel defaults an untuned host has (a sender keeps at most ~4 MiB in flight, ~110 Mbit/s at
# 300 ms per stream); "tuned": 64 MiB, what the emulator sets by default, enough for one stream to
# fill 400 Mbit/s x 300 ms.
TCP_BUFFERS = {
    "linux": {"net.ipv4.tcp_rmem": "4096 131072 6291456", "net.ipv4.tcp_wmem": "4096 16384 4194304"},
    "tuned": {"net.ipv4.tcp_rmem": "4096 131072 67108864", "net.ipv4.tcp_wmem": "4096 65536 67108864"},
}


def url_of(host: Host, port: int = GATEWAY_PORT, tls: bool = False) -> str:
    """The URL of a server on `host` (its own address, routed from its neighbours)."""
    return f"{'https' if tls else 'http'}://{host.ip}:{port}"


@dataclass
class Agent:
    name: str
    proc: subprocess.Popen
    ready: Path
    out: Path
    log: Path

    def result(self) -> dict:
        return json.loads(self.out.read_text())

    def log_tail(self, n: int = 2000) -> str:
        return log_tail(self.log, n)


@dataclass
class Batch:
    """Agents that start their work together: set up, then all released at once by one go file."""

    mesh: "Mesh"
    go: Path
    agents: list[Agent] = field(default_factory=list)

    def add(self, host: Host, name: str, command: str, *args: str) -> Agent:
        stem = self.mesh.work / f"{self.go.stem}-{name}"
        ready, out, log_path = (stem.with_suffix(s) for s in (".ready", ".json", ".log"))
        argv = [sys.executable, str(AGENT), command, *args, "--ready", str(ready), "--go", str(self.go),
                "--out", str(out)]
        with open(log_path, "ab") as log_file:
            proc = host.spawn(argv, stdout=log_file, stderr=subprocess.STDOUT)
        agent = Agent(name, proc, ready, out, log_path)
        self.agents.append(agent)
        return agent

    def start(self, timeout_s: float = 120.0) -> float:
        """Wait until every agent is ready, then release them; returns the release time."""
        self._wait_each(lambda agent: agent.ready, "not ready", timeout_s)
        t0 = time.time()
        self.go.touch()
        return t0

    def finish(self, timeout_s: float, on_results: Callable[[], object] | None = None) -> dict[str, dict]:
        """Wait for every agent's result (name -> JSON); raises with the agent's log if one fails.
        Agents that keep their connections open after their result (transfer_protocol.results_then_linger)
        close them once all results are in and `on_results` (a last look at the links) has run."""
        deadline = time.monotonic() + timeout_s
        self._wait_each(lambda agent: agent.out, "still running", timeout_s)
        if on_results is not None:
            on_results()
        end_file(self.go).touch()
        for agent in self.agents:
            left = max(0.1, deadline - time.monotonic())
            try:
                agent.proc.wait(timeout=left)
            except subprocess.TimeoutExpired:
                raise WanError(f"agent {agent.name} still running after {timeout_s:g} s:\n{agent.log_tail()}") from None
            self._check_alive(agent)
        return {agent.name: agent.result() for agent in self.agents}

    def _wait_each(self, file_of: Callable[[Agent], Path], late: str, timeout_s: float) -> None:
        """Wait until every agent has created its `file_of` file; raise (`late`, with its log) after the timeout."""
        deadline = time.monotonic() + timeout_s
        for agent in self.agents:
            while not file_of(agent).exists():
                self._check_alive(agent)
                if time.monotonic() > deadline:
                    raise WanError(f"agent {agent.name} {late} after {timeout_s:g} s:\n{agent.log_tail()}")
                time.sleep(0.02)

    @staticmethod
    def _check_alive(agent: Agent) -> None:
        code = agent.proc.poll()
        if code is not None and (code != 0 or not agent.out.exists()):
            raise WanError(f"agent {agent.name} exited with {code}:\n{agent.log_tail()}")


class Mesh:
    """One scenario's emulated network plus its processes, working folder and trainer key."""

    def __init__(self, wan: Wan, work: Path, congestion: str = ""):
        self.wan = wan
        self.congestion = congestion
        """Every gateway's `congestion` setting ("": the host's default)."""
        self.work = work
        self.work.mkdir(parents=True, exist_ok=True)
        self.key = generate_key()
        self.private_key = work / "trainer.key"
        self.public_key = save_keypair(self.key, self.private_key)
        self.pki = RunPki(work / "pki")
        self._gateways: dict[tuple[str, int], str] = {}
        self._batches = 0

    def batch(self) -> Batch:
        self._batches += 1
        return Batch(self, self.work / f"run{self._batches:03d}.go")

    def gateway(self, host: Host, region: str, upstreams: list[str] = (), *, relay_connections: int = 4,
                port: int = GATEWAY_PORT, extra: list[str] = (), tls: bool = False) -> str:
        """Start a `deltamesh gateway` on `host` (serving HTTPS with a certificate of the run's CA if
        `tls`) and wait until it answers; returns its URL."""
        url = url_of(host, port, tls)
        args = [DELTAMESH, "gateway", "--region", region, "--listen", f"0.0.0.0:{port}",
                "--store", str(self.work / f"store-{region}"), "--trusted-key", str(self.public_key),
                "--advertise", url, "--anonymous", "--relay-connections", str(relay_connections),
                "--keep-fulls", "1", "--probe-interval-s", "2", *extra]
        if self.congestion:
            args += ["--congestion", self.congestion]
        if tls:
            args += self.pki.server_flags(host.ip, region)
        for up in upstreams:
            args += ["--upstream", up]
        self.spawn_logged(host, f"gateway-{region}", args)
        self._gateways[(host.name, port)] = url
        self.wait_http(host, f"{url}/healthz")
        return url

    def file_server(self, host: Host, path: Path, *, serial: bool = False) -> str:
        """Start the plain HTTP server of one file on `host`; returns the file's URL."""
        argv = [sys.executable, str(AGENT), "serve", "--file", str(path), "--port", str(FILE_PORT)]
        self.spawn_logged(host, f"files-{host.name}", argv + (["--serial"] if serial else []))
        base = url_of(host, FILE_PORT)
        self.wait_http(host, f"{base}/stats")
        return f"{base}/version.bin"

    def spawn_logged(self, host: Host, name: str, argv: list[str]) -> subprocess.Popen:
        with open(self.work / f"{name}.log", "ab") as log_file:
            return host.spawn(argv, stdout=log_file, stderr=subprocess.STDOUT)

    def ca_args(self, url: str) -> list[str]:
        """The agent flags that verify `url` against the run's CA, if it is https://."""
        return ["--ca", str(self.pki.ca)] if url.startswith("https://") else []

    def wait_http(self, host: Host, url: str, timeout_s: float = 90.0) -> None:
        host.run([sys.executable, str(AGENT), "wait-http", url, "--timeout", str(timeout_s), *self.ca_args(url)],
                 timeout=timeout_s + 30)

    def fetch(self, host: Host, url: str) -> str:
        return host.run([sys.executable, str(AGENT), "fetch", url, *self.ca_args(url)], timeout=60).stdout

    def gateway_bytes_out(self, host: Host, port: int = GATEWAY_PORT) -> int:
        """Piece bytes the gateway on `host` has served so far (its Prometheus counter)."""
        base = self._gateways.get((host.name, port), url_of(host, port))
        text = self.fetch(host, f"{base}/metrics")
        return int(metric_sum(text, "deltamesh_gateway_bytes_out_total"))

    def file_bytes_out(self, host: Host) -> int:
        return int(json.loads(self.fetch(host, f"{url_of(host, FILE_PORT)}/stats"))["bytes_served"])


def metric_sum(text: str, name: str) -> float:
    """Sum of every sample of metric `name` in Prometheus text format."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def wire_tx_bytes(host: Host) -> int:
    """Bytes (with TCP/IP headers) that have left `host` on its links so far."""
    out = subprocess.run(["ip", "-n", host.namespace, "-j", "-s", "link", "show"], capture_output=True, text=True,
                         check=True).stdout
    return sum(i["stats64"]["tx"]["bytes"] for i in json.loads(out) if i["ifname"] != "lo")


# Every host keeps an idle connection's congestion window (Linux otherwise restarts slow start after
# an idle RTO): what deltamesh's deployment notes ask of gateway and pool hosts on long links, and
# what lets a connection kept open between versions resume at the rate it had. Set for every method.
HOST_SYSCTLS = {"net.ipv4.tcp_slow_start_after_idle": "0"}
_ALLOWED_CC = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")


def set_tcp_buffers(wan: Wan, profile: str, congestion: str, initcwnd: int = 0) -> None:
    """The hosts' TCP buffer limits (`TCP_BUFFERS[profile]`), congestion control and `HOST_SYSCTLS`;
    with `initcwnd`, that many segments of initial congestion and receive window on every route."""
    cc = {"net.ipv4.tcp_congestion_control": congestion}
    settings = [f"{k}={v}" for k, v in {**TCP_BUFFERS[profile], **HOST_SYSCTLS, **cc}.items()]
    if initcwnd:
        settings.append(f"net.ipv4.tcp_rmem={initial_rmem(TCP_BUFFERS[profile]['net.ipv4.tcp_rmem'], initcwnd)}")
    for host in wan.hosts.values():
        host.run(["sysctl", "-q", "-w", *settings])
        if initcwnd:
            set_initial_windows(host, initcwnd)


def initial_rmem(rmem: str, segments: int) -> str:
    """`tcp_rmem` with a default (middle) buffer big enough for a first receive window of `segments`
    full segments: Linux advertises about half of it, so 131072 (the default) caps the first window
    at ~45 segments whatever `initrwnd` says."""
    low, default, high = (int(x) for x in rmem.split())
    return f"{low} {max(default, 4 * 1500 * segments)} {high}"


def set_initial_windows(host: Host, segments: int) -> None:
    """What an operator does for a long link (docs/api/gateway.md, "Long links"): every route of
    `host` gets `initcwnd` and `initrwnd` of `segments`, so a new connection's first round trip may
    carry that many segments instead of Linux's 10 (the sender's initcwnd; the receiver's initrwnd,
    with a `tcp_rmem` default that admits it, lets it advertise a window that takes them). Applies
    to the routes there now."""
    routes = json.loads(host.run(["ip", "-j", "route", "show"]).stdout or "[]")
    for r in routes:
        argv = ["ip", "route", "replace", r["dst"], "dev", r["dev"]]
        for key, word in (("gateway", "via"), ("prefsrc", "src"), ("scope", "scope"), ("protocol", "proto")):
            if r.get(key):
                argv += [word, str(r[key])]
        host.run([*argv, "initcwnd", str(segments), "initrwnd", str(segments)])


@contextmanager
def congestion_allowed(name: str) -> Iterator[None]:
    """Let network namespaces choose congestion control `name` (Linux lets them pick only from the
    machine's allowed list), and put the machine's list back afterwards."""
    before = _ALLOWED_CC.read_text().split()
    if name not in before:
        _ALLOWED_CC.write_text(" ".join([*before, name]))
    try:
        yield
    finally:
        if name not in before:
            _ALLOWED_CC.write_text(" ".join(before))


def route_through(near: Host, middle: Host, far: Host) -> None:
    """Let `near` and `far` (both linked to `middle`, not to each other) talk through `middle`.

    `middle` forwards IP packets between its links. Its link delays are NFQUEUE rules on its INPUT
    chain, which forwarded packets do not pass, so each such rule is mirrored on the FORWARD chain
    (same interface, same delayer queue): a forwarded packet is delayed exactly as one delivered
    locally, and the rate limits apply on the way out as for any packet.
    """
    middle.run(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1"])
    rules = middle.run(["iptables", "-w", "-S", "INPUT"]).stdout.splitlines()
    forward = middle.run(["iptables", "-w", "-S", "FORWARD"]).stdout
    for rule in rules:
        if rule.startswith("-A INPUT ") and "NFQUEUE" in rule:
            mirrored = rule.replace("-A INPUT ", "-A FORWARD ", 1)
            if mirrored not in forward:
                middle.run(["iptables", "-w", *mirrored.split()])
    near.run(["ip", "route", "replace", f"{far.ip}/32", "via", near.addr_of(middle), "src", near.ip])
    far.run(["ip", "route", "replace", f"{near.ip}/32", "via", far.addr_of(middle), "src", far.ip])
