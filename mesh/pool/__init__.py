"""Rollout pools: the `deltamesh pool run` process. A pool serves one or more policies, each with an
engine whose weights follow the region's gateway (hot-swapped in place where the engine can), and a
rollout worker that leases tasks from the broker, runs the workflow and submits trajectories.

Modules: `config` (PoolConfig), `pool` (RolloutPool: the wiring), `weights` (a policy's weight-sync
loop), `worker` (the lease/episode/submit loop), `staleness` (when leasing is allowed), `batching`
(merging concurrent generate calls), `engines`, `status` (HTTP status and /metrics), `metrics`.
Import from the modules; this package imports nothing heavy.
"""
