"""TCP congestion control chosen per listening socket, by name (Linux's `TCP_CONGESTION`).

A server that sends bulk bytes (a gateway serving pieces) decides how its connections react to loss:
the sender's congestion control sets the rate, and connections a listening socket accepts inherit its
choice. Linux offers the algorithms in `net.ipv4.tcp_available_congestion_control` (modules loaded);
a process without CAP_NET_ADMIN may set only those in `net.ipv4.tcp_allowed_congestion_control`.
`set_congestion` checks a name against both and says which list to change when it cannot be set, so
a gateway refuses to start rather than serve with an algorithm other than the one asked for.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

AVAILABLE = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
_NAME = re.compile(r"[a-z0-9_]{1,15}")  # the kernel's TCP_CA_NAME_MAX is 16 bytes with the NUL


class CongestionError(ValueError):
    """A congestion control that cannot be set here; the message says why and what to change."""


def check_name(name: str) -> None:
    """Raise CongestionError unless `name` could name a congestion control ("" means the host's default)."""
    if name and not _NAME.fullmatch(name):
        raise CongestionError(f"congestion {name!r} is not a congestion control name (e.g. bbr, cubic)")


def _listed(path: Path) -> list[str]:
    try:
        return path.read_text().split()
    except OSError as e:
        raise CongestionError(f"congestion control cannot be chosen on this host: {path} unreadable "
                              f"({e.strerror or e}); leave congestion empty for the host's default") from None


def set_congestion(sock: socket.socket, name: str) -> None:
    """Make `name` the congestion control of `sock` (a listening socket: every connection it accepts
    inherits it); "" leaves the host's default. CongestionError, saying what to change, when the host
    does not offer `name` or does not let this process use it."""
    check_name(name)
    if not name:
        return
    available = _listed(AVAILABLE)
    if name not in available:
        raise CongestionError(f"congestion control {name!r} is not available on this host (available: "
                              f"{' '.join(available)}; its module may need loading: modprobe tcp_{name})")
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())
    except PermissionError:
        raise CongestionError(f"congestion control {name!r} is not allowed for this process (allowed: "
                              f"{' '.join(_listed(ALLOWED))}): add it to net.ipv4.tcp_allowed_congestion_control, "
                              f"or make it the host's default (sysctl -w net.ipv4.tcp_congestion_control={name})") from None
    except OSError as e:
        raise CongestionError(f"congestion control {name!r} could not be set: {e.strerror or e}") from None


def congestion_of(sock: socket.socket) -> str:
    """The congestion control `sock` uses."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0", 1)[0].decode()
