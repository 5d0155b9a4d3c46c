"""The trainer: its loop, RL losses, publishing through a gateway, and the trainer's side of the data
interface (the trajectory and batch format and the client of the broker's batch API).
Imports `deltamesh.delta` and `deltamesh.gateway`.
"""
