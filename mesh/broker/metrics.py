"""Prometheus metrics of one broker, in its own registry (several brokers can share a test process)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from deltamesh.metrics import service_registry


class BrokerMetrics:
    def __init__(self) -> None:
        self.registry = service_registry("broker")
        r = self.registry
        self.ingested = Counter("deltamesh_broker_trajectories_ingested_total", "Trajectories stored",
                                ["model_id"], registry=r)
        self.duplicates = Counter("deltamesh_broker_trajectories_duplicate_total",
                                  "Trajectories submitted again and skipped", registry=r)
        self.rejected = Counter("deltamesh_broker_requests_rejected_total",
                                "Requests refused or failed, by HTTP status (5xx: the broker's own failures)",
                                ["status"], registry=r)
        self.refused = Counter("deltamesh_broker_trajectories_refused_total",
                               "Submissions refused for what their trajectories claim: version_ahead (a policy "
                               "version above the trainer's newest, beyond policies.max_version_ahead), "
                               "lease_not_held (a group of another pool's lease)", ["model_id", "reason"],
                               registry=r)
        self.dropped = Counter("deltamesh_broker_connections_dropped_total",
                               "Connections closed unanswered: header_timeout (request headers not in within "
                               "header_timeout_s), address_cap (over max_connections_per_address)", ["reason"],
                               registry=r)
        self.commits = Counter("deltamesh_broker_commits_total", "Group commits of submissions", registry=r)
        self.groups = Counter("deltamesh_broker_groups_total", "Completed groups by outcome",
                              ["model_id", "outcome"], registry=r)
        self.batches = Counter("deltamesh_broker_batches_served_total", "Batches delivered to trainers",
                               ["model_id"], registry=r)
        self.acks = Counter("deltamesh_broker_batch_acks_total",
                            "Batch acknowledgements by outcome: acked, duplicate (already acked), late (the batch "
                            "was requeued first), unknown", ["model_id", "outcome"], registry=r)
        self.requeued = Counter("deltamesh_broker_batches_requeued_total",
                                "Unacknowledged batches whose groups went back to the buffer: deadline (ack "
                                "deadline passed) or not_held (the trainer polled without holding it)",
                                ["model_id", "reason"], registry=r)
        self.unacked = Gauge("deltamesh_broker_batches_unacked", "Batches delivered and awaiting their ack",
                             ["model_id"], registry=r)
        self.batch_samples = Counter("deltamesh_broker_batch_samples_total", "Samples served, fresh or replay",
                                     ["model_id", "source"], registry=r)
        self.batch_seconds = Histogram("deltamesh_broker_batch_build_seconds",
                                       "Time to take and encode a ready batch", ["model_id"], registry=r,
                                       buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
        self.buffer_samples = Gauge("deltamesh_broker_buffer_samples", "Samples waiting, by buffer",
                                    ["model_id", "buffer"], registry=r)
        self.trainer_version = Gauge("deltamesh_broker_trainer_version", "Latest version a trainer reported",
                                     ["model_id"], registry=r)
        self.leases = Counter("deltamesh_broker_leases_total",
                              "Leases issued, expired, prompts skipped, and requests held_back (the pool serves "
                              "a version beyond policies.max_staleness of the training version)",
                              ["event"], registry=r)
        self.wait_fraction = Gauge("deltamesh_broker_wait_fraction", "Trainer wait fraction over the window",
                                   ["model_id"], registry=r)
        self.target_gpus = Gauge("deltamesh_broker_target_gpus", "Rollout GPU target per trainer",
                                 ["model_id"], registry=r)
        self.leader = Gauge("deltamesh_broker_active", "1 while this broker is the active one (always, on SQLite)",
                            registry=r)
        self.elections = Counter("deltamesh_broker_elections_total",
                                 "Times this broker took the leadership lease and rebuilt its state", registry=r)
        self.rollout_gpus = Gauge("deltamesh_broker_rollout_gpus", "GPUs of pools seen recently", registry=r)
