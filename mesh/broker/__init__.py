"""The central dataflow broker: rollout tasks out to pools in every region, trajectories in, data
policies applied, and training batches out to each trainer. Pools and trainers never know about each
other; they meet only here, at the data interface defined in `deltamesh.trainer.data`.

`server.build_app` is the HTTP service (`deltamesh broker`), `service.Broker` the logic behind it,
`sqlite_store.SqliteStore` the embedded durable store behind the narrow `store.BrokerStore` interface,
`policies`/`curators` the plug-in data policies, `balance` the wait-fraction report that drives the
autoscaler, and `client.PoolClient` the pools' client.
"""
