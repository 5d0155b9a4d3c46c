"""The weight network: regional gateway servers, their version store, relays, the publisher and the
pool-side puller, and link probes. Imports only `deltamesh.delta` among deltamesh components.
"""
