"""The settings that moved between config layouts, so that a file written for an older layout fails
naming where each of its keys went instead of with a bare "unknown key".

`MOVED_KEYS` pairs an old dotted path with its new one, both from the file's root (`train` is the
old `[train]` table, `pool.stall_timeout_s` a key of `[pool]`). `REMOVED_KEYS` pairs a setting that
is gone with what replaces it. `deltamesh.config.load_config` checks every file it reads against the
entries that concern the table it loads. A move or removal is recorded here when it is made; the
tables only grow, and are immutable.
"""

from __future__ import annotations

from typing import Any, Mapping

MOVED_KEYS: tuple[tuple[str, str], ...] = (
    # The trainer read two tables; its loop settings ([train]) now sit in [trainer] beside the core's.
    ("train", "trainer"),
    # The rollout pool's weight sync settings were copied into [pool]; they are its [pool.sync] section.
    ("pool.gateways", "pool.sync.gateways"),
    ("pool.token", "pool.sync.token"),
    ("pool.trusted_keys", "pool.sync.trusted_keys"),
    ("pool.gpus", "pool.sync.gpus"),
    ("pool.tier", "pool.sync.tier"),
    ("pool.connections", "pool.sync.connections"),
    ("pool.heartbeat_s", "pool.sync.heartbeat_s"),
    ("pool.poll_wait_s", "pool.sync.poll_wait_s"),
    ("pool.stall_timeout_s", "pool.sync.stall_timeout_s"),
    ("pool.give_up_s", "pool.sync.give_up_s"),
    ("pool.full_every", "pool.sync.full_every"),
    # The rollout worker's settings are the [pool.worker] section.
    ("pool.workflow", "pool.worker.workflow"),
    ("pool.workflow_options", "pool.worker.workflow_options"),
    ("pool.roles", "pool.worker.roles"),
    ("pool.max_staleness", "pool.worker.max_staleness"),
    ("pool.lease_batch", "pool.worker.lease_batch"),
    ("pool.max_episodes", "pool.worker.max_episodes"),
    ("pool.idle_s", "pool.worker.idle_s"),
    ("pool.broker_refresh_s", "pool.worker.broker_refresh_s"),
    ("pool.submit_retries", "pool.worker.submit_retries"),
    ("pool.drain_s", "pool.worker.drain_s"),
    # The pool's plan hint shared its name with the trainer's full_every (a full every N versions).
    ("pool.sync.full_every", "pool.sync.full_after_deltas"),
    # The scaling thresholds were declared twice, in the broker's balance table and the autoscaler's.
    ("broker.balance.scale_up_above", "broker.balance.thresholds.scale_up_above"),
    ("broker.balance.scale_down_below", "broker.balance.thresholds.scale_down_below"),
    ("broker.balance.headroom", "broker.balance.thresholds.headroom"),
    ("autoscale.scale_up_above", "autoscale.thresholds.scale_up_above"),
    ("autoscale.scale_down_below", "autoscale.thresholds.scale_down_below"),
    ("autoscale.headroom", "autoscale.thresholds.headroom"),
)

REMOVED_KEYS: tuple[tuple[str, str], ...] = (
    # A gateway's pools shared plain region tokens; every caller now has its own hashed, scoped token.
    ("gateway.pool_tokens", "use `gateway.tokens_file`, a hashed tokens file with one token per pool "
                            "(role pool, named after the pool; docs/api/gateway.md)"),
    # Every broker call of a pool is retried now, failing over between the brokers it names.
    ("pool.worker.submit_retries", "a pool retries every broker call (failing over between the URLs of "
                                   "`pool.broker`) for up to a minute on its own (docs/api/broker.md)"),
)

_ABSENT = object()


def moved_keys_in(data: Mapping[str, Any], section: str) -> list[str]:
    """One line per key of an older layout found in `data` (a whole config file) that concerns the
    table `section`: "[train] moved to [trainer]", "`pool.gpus` moved to `pool.sync.gpus`"."""
    found = []
    for old, new in MOVED_KEYS:
        if not (_within(old, section) or _within(new, section)):
            continue
        value = _lookup(data, old)
        if value is _ABSENT:
            continue
        if "." not in old:  # a whole table
            found.append(f"[{old}] moved to [{new}]")
        else:
            found.append(f"`{old}` moved to `{new}`")
    for old, instead in REMOVED_KEYS:
        if _within(old, section) and _lookup(data, old) is not _ABSENT:
            found.append(f"`{old}` was removed: {instead}")
    return found


def _within(path: str, section: str) -> bool:
    return path == section or path.startswith(section + ".")


def _lookup(data: Mapping[str, Any], path: str) -> Any:
    node: Any = data
    for part in path.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return _ABSENT
        node = node[part]
    return node
