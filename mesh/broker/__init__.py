"""The central dataflow broker: rollout tasks out to pools in every region, trajectories in, data
policies applied, and training batches out to each trainer. Pools and trainers never know about each
other; they meet only here, at the data interface defined in `deltamesh.data`.

`server.build_app` is the HTTP service (`deltamesh broker`; API in docs/api/broker.md), `service.Broker`
the logic behind it, `delivery.BatchDelivery` its batches out to trainers (at least once, held until
acknowledged), `runner.StoreRunner` its store thread with group commit, `sqlite_store.SqliteStore`
the embedded durable store behind the narrow `store.BrokerStore` interface and
`postgres_store.PostgresStore` the server one (`postgres_schema` its tables and migrations,
`ingest_plan` its group commit decided in memory, `store_rows` what both share, `stores.open_store`
the choice by `--db`), `tasks` the dataset and
leases, `policies`/`curators` the plug-in data policies, `balance` the wait-fraction report that
drives the autoscaler (`deltamesh.mesh.autoscale`), `json_form` the JSON submission form, and
the pools and trainers reach it through `deltamesh.broker_client.BrokerClient`.
"""
