"""Rollout pools: the `deltamesh pool run` process, and the pool's side of the weight protocol. A pool
serves one or more policies, each with an engine whose weights follow the region's gateway
(hot-swapped in place where the engine can), and a rollout worker that leases tasks from the broker,
runs the workflow and submits trajectories.

Modules: `config` (PoolConfig), `pool` (RolloutPool: the wiring), `weights` (a policy's weight-sync
round: plan -> verified pieces -> decode -> engine swap -> check -> persist -> report, top to bottom),
`weight_sync` (WeightSync: head, plan, verified steps, persist), `sync_config` ([pool.sync]), `head_check` and `head_watch` (no
rollback, one weights hash per version, stale gateways), `supersede`, `presence` (registration and
heartbeats), `retry_log` (backoff and one log line per outage), `sync_metrics` (`deltamesh pool sync`'s
metrics), `worker` (the lease/episode/submit loop), `staleness` (when leasing is allowed), `batching`
(merging concurrent generate calls), `serve_check`, `dir_writer`, `timeline`, `metrics`.
The face is loaded on first use: this package imports nothing heavy.
"""

from deltamesh.lazy_face import lazy_face

__getattr__, __all__ = lazy_face(__name__, {
    "WeightSync": "deltamesh.mesh.pool.weight_sync",
    "PoolConfig": "deltamesh.mesh.pool.config",
    "PoolSyncConfig": "deltamesh.mesh.pool.sync_config",
    "WeightSyncSettings": "deltamesh.mesh.pool.sync_config",
    "RolloutPool": "deltamesh.mesh.pool.pool",
})
