"""The top of deltamesh: rollout pools, the dataflow broker, the autoscaler, topology and the CLI.

`mesh` may import every other component; nothing imports `mesh`.
"""
