"""The exit codes of `deltamesh` commands, and which expected failure gets which (docs/CLI.md).

An expected failure (a key file that is missing or of the wrong kind, a port in use, a URL that does
not answer, credentials refused, a full disk) ends a command with one line on stderr and its own
code, so that scripts and service managers can tell them apart (systemd's
`RestartPreventExitStatus=2 4 5` keeps a unit from restarting into the same wrong input). Anything
else is a bug and keeps its traceback.
"""

from __future__ import annotations

import errno
from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    FAILED = 1
    """The operation did not succeed (a refused publish, a sync that could not complete)."""
    USAGE = 2
    """The user's input is wrong: flags, config, a key or token file missing, unreadable or of the wrong kind."""
    UNREACHABLE = 3
    """A URL the command needs did not answer (connection refused, no route, DNS, time-out)."""
    REFUSED = 4
    """Credentials refused (HTTP 401/403): a wrong or revoked token, a client certificate not allowed."""
    PORT_IN_USE = 5
    """The listen address is taken by another process (or not this host's to bind)."""
    DISK_FULL = 6
    """No space left for the store, the pool directory or the database (a gateway's 507 too)."""
    STALE = 7
    """The gateways are behind: `pool sync --once` synced as far as they go, but a newer version is known
    to exist (the trainer's signed head statement, another gateway's head) or a gateway is flagged stale
    (a frozen or lagging relay). The directory holds a whole version, just not the newest."""


_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
_CANNOT_BIND = (errno.EADDRINUSE, errno.EADDRNOTAVAIL)


def expected_exit(error: BaseException) -> Exit | None:
    """The exit code of an expected failure, or None for an error that is not one (a bug). An error
    raised from an expected failure (`raise RuntimeError(...) from e`) is the failure it wraps."""
    while error is not None:
        found = _own_exit(error)
        if found is not None:
            return found
        error = error.__cause__
    return None


def _own_exit(error: BaseException) -> Exit | None:
    from deltamesh.delta.errors import KeyFileError
    from deltamesh.gateway.fetch.errors import CredentialsError
    from deltamesh.gateway.server.disk import DiskFullError
    from deltamesh.http import HttpError

    if isinstance(error, KeyFileError):
        return Exit.USAGE
    if isinstance(error, CredentialsError):
        return Exit.REFUSED
    if isinstance(error, HttpError):
        if error.status == 0:
            return Exit.UNREACHABLE
        if error.status in (401, 403):
            return Exit.REFUSED
        if error.status == 507:
            return Exit.DISK_FULL
        return None
    if isinstance(error, OSError):
        if error.errno in _NO_SPACE:
            return Exit.DISK_FULL
        if error.errno in _CANNOT_BIND:
            return Exit.PORT_IN_USE
    if isinstance(error, DiskFullError):
        return Exit.DISK_FULL
    return None


def exit_code(error: BaseException, default: int) -> int:
    """The code of an expected failure, else `default` (what the command's own handler chose)."""
    found = expected_exit(error)
    return int(found) if found is not None else default


def describe(error: BaseException) -> str:
    """One line for an expected failure: an OSError without its "[Errno N]" prefix."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror if error.filename is None else f"{error.filename}: {error.strerror}"
    return " ".join(str(error).split())
