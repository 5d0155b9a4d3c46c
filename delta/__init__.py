"""The codec: bit-diff deltas and full snapshots of model weights, their signed container, and apply.

Imports no other deltamesh component and touches no network.
"""
