"""Running the system tools the emulator drives (`ip`, `tc`, `iptables`, `sysctl`), and the
emulator's one error type. Every call is logged at debug level and fails loudly with the tool's
own message, so a broken set-up says which command broke and why.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Sequence

log = logging.getLogger(__name__)


class WanError(RuntimeError):
    """The emulator could not build, check or remove part of the emulated network."""


def run(args: Sequence[str], *, timeout: float = 30.0, check: bool = True) -> str:
    """Run a command to completion; return its stdout, raise WanError when it fails."""
    log.debug("run: %s", " ".join(args))
    try:
        done = subprocess.run(list(args), capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise WanError(f"{' '.join(args)}: {exc}") from exc
    if check and done.returncode != 0:
        raise WanError(f"{' '.join(args)} exited {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def in_netns(namespace: str, args: Sequence[str]) -> list[str]:
    """The command line that runs `args` inside a network namespace."""
    return ["ip", "netns", "exec", namespace, *args]
