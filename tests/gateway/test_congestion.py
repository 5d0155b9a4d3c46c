"""The gateway's `congestion` setting (an operator's, in `[gateway]` or `--congestion`): the connections a
gateway process accepts use the congestion control it names, seen from outside with `ss`; a name the
host does not offer stops the gateway at start with one line saying so, before it binds its port or
opens its store; a name the host offers but does not let the process use is refused naming the sysctl
to change. Real processes and sockets on loopback. The host-wide alternative the docs show (the
`sysctl` line in docs/api/gateway.md, Long links) runs as written in a network namespace of its own."""

from __future__ import annotations

import http.client
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from deltamesh.congestion import ALLOWED, AVAILABLE, CongestionError, congestion_of, set_congestion
from deltamesh.gateway.config import GatewayConfig
from deltamesh.http import listen_socket
from deltamesh.mesh.cli.exits import Exit
from deltamesh.mesh.demo.processes import free_port

ROOT = Path(__file__).resolve().parents[2]
DELTAMESH = str(Path(sys.executable).with_name("deltamesh"))
DEFAULT = Path("/proc/sys/net/ipv4/tcp_congestion_control")


def listed(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError:
        pytest.skip(f"no {path} here (not Linux)")


def other_than_default() -> str:
    """An algorithm this process may set that is not the host's default (bbr when it can be), so that
    seeing it on a connection shows the setting took effect."""
    default = DEFAULT.read_text().strip()
    usable = listed(AVAILABLE) if os.geteuid() == 0 else listed(ALLOWED)
    choices = sorted((c for c in usable if c != default), key=lambda c: c != "bbr")
    if not choices:
        pytest.skip(f"only the host's default congestion control ({default}) can be set here")
    return choices[0]


def test_an_accepted_connection_inherits_the_listening_sockets_congestion_control():
    name = other_than_default()
    server = listen_socket("127.0.0.1", 0)
    set_congestion(server, name)
    with server, socket.create_connection(server.getsockname()[:2]) as client:
        accepted, _ = server.accept()
        with accepted:
            assert congestion_of(server) == name
            assert congestion_of(accepted) == name
            assert congestion_of(client) == DEFAULT.read_text().strip()  # the other end keeps the host's


def test_a_gateway_process_serves_with_the_congestion_control_it_is_given(spawn_gateway):
    name = other_than_default()
    gw = spawn_gateway("eu", extra=["--congestion", name])
    port = int(gw.url.rsplit(":", 1)[1])
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", "/healthz")  # kept alive: the gateway's accepted socket stays established
        assert conn.getresponse().read()
        shown = subprocess.run(["ss", "-Htin", "state", "established", f"( sport = :{port} )"],
                               capture_output=True, text=True, check=True).stdout
    finally:
        conn.close()
    assert shown.strip(), "ss shows no connection of the gateway"
    # ss -i prints the algorithm as a word of its own ("bbr", "reno wscale:...", ...).
    assert re.search(rf"(^|\s){name}(\s|$)", shown), shown


def test_an_unknown_congestion_control_stops_the_gateway_at_start(tmp_path, trainer_key):
    port = free_port()
    store = tmp_path / "store"
    done = subprocess.run([DELTAMESH, "gateway", "--listen", f"127.0.0.1:{port}", "--store", str(store),
                           "--anonymous", "--trusted-key", str(trainer_key.public), "--congestion", "nosuchcc"],
                          capture_output=True, text=True, timeout=60)
    lines = done.stderr.strip().splitlines()
    assert done.returncode == Exit.USAGE and "Traceback" not in done.stderr, done.stderr
    assert len(lines) == 1 and "congestion control 'nosuchcc' is not available on this host" in lines[0], lines
    assert "available: " in lines[0]
    assert not store.exists()  # stopped before the store was opened
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # and its port was let go


def test_a_malformed_name_is_refused_by_the_config(trainer_key):
    with pytest.raises(CongestionError, match="not a congestion control name"):
        GatewayConfig(trusted_keys=[str(trainer_key.public)], anonymous=True, congestion="bbr; reboot")
    assert GatewayConfig(trusted_keys=[str(trainer_key.public)], anonymous=True).congestion == ""


CHILD = """import sys
from deltamesh.congestion import CongestionError, set_congestion
from deltamesh.http import listen_socket
try:
    set_congestion(listen_socket("127.0.0.1", 0), sys.argv[1])
except CongestionError as e:
    sys.exit(str(e))
"""


def test_an_algorithm_the_host_does_not_allow_is_refused_naming_the_sysctl():
    """Without CAP_NET_ADMIN (dropped from the bounding set by setpriv), only the allowed list may be set."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to start a process without CAP_NET_ADMIN")
    blocked = [c for c in listed(AVAILABLE) if c not in listed(ALLOWED) and c != DEFAULT.read_text().strip()]
    if not blocked:
        pytest.skip("every available congestion control is allowed here")
    done = subprocess.run(["setpriv", "--bounding-set", "-net_admin", "--inh-caps", "-net_admin",
                           sys.executable, "-c", CHILD, blocked[0]], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"congestion control {blocked[0]!r} is not allowed for this process" in done.stderr, done.stderr
    assert "net.ipv4.tcp_allowed_congestion_control" in done.stderr


@pytest.mark.netns
def test_the_documented_host_wide_sysctl_runs_as_written(tmp_path, run_documented_lines):
    text = (ROOT / "docs" / "api" / "gateway.md").read_text()
    section = text[text.index("### Host tuning"):text.index("\n## ", text.index("### Host tuning"))]
    (block,) = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    lines = [line for line in block.splitlines() if line.strip()]
    wanted = re.search(r"tcp_congestion_control=(\w+)", block).group(1)
    if wanted not in listed(AVAILABLE):
        pytest.skip(f"{wanted} is not available on this host")
    before = next((c for c in listed(AVAILABLE) if c != wanted), None)
    if before is None:
        pytest.skip(f"nothing but {wanted} is available here")
    # The namespace starts on another default, so that the documented line is what changes it.
    lines = [f"sysctl -q -w net.ipv4.tcp_congestion_control={before}", *lines]
    check = ("import socket; s = socket.socket(); "
             "print(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(bytes(1))[0].decode())")
    ran = run_documented_lines(lines, tmp_path, after=[f"python -c '{check}'"])
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split()[-1] == wanted  # a new socket in that namespace gets it without asking
