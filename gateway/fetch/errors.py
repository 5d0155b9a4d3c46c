"""Why a pool's weight sync could not go on: the errors `deltamesh.mesh.pool.weight_sync` raises.

`SyncError` is a round that could not complete (no gateway answered, the plan's data did not verify);
the loops log it and try again from where the pool is. `Refused` is a round that ended because a
gateway offered something the pool will not take (`deltamesh.mesh.pool.head_check`): the next round
goes to another gateway. `CredentialsError` is every gateway refusing the pool's credentials: nothing
will come until an operator acts, so the loops end with it, as one error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deltamesh.http import HttpError


class SyncError(Exception):
    """A transfer that could not complete (no gateway answered, or the plan's data did not verify)."""


class Refused(SyncError):
    """A gateway offered something the pool will not take (a rollback, another weights hash for a
    verified version, a forged head statement); the next round goes to another gateway."""


class CredentialsError(SyncError):
    """Every gateway refused the pool's credentials (401/403)."""


def credentials_refused(pool: str, reasons: list[str]) -> CredentialsError:
    return CredentialsError(f"pool {pool}: every gateway refused its credentials ({'; '.join(reasons)}): check "
                            f"its token, or its client certificate (common name pool/{pool})")


def unreachable(errors: list[HttpError]) -> HttpError | None:
    """The error to chain to a SyncError when no gateway could be reached at all, so that the command's
    exit code says so (3, docs/CLI.md); None when one of them answered, if only with an error."""
    return errors[-1] if errors and all(e.status == 0 for e in errors) else None
