"""deltamesh: multi-region weight distribution and rollout mesh for RL of LLMs.

The distribution's root package holds only what every component shares and nothing that belongs
to one of them: the package version, the one config loader (`deltamesh.config`) and logging set-up
(`deltamesh.logs`). The components are `deltamesh.delta` (codec), `deltamesh.gateway` (weight
network), `deltamesh.trainer` (trainer and data interface) and `deltamesh.mesh` (pools, broker, CLI).
"""

__version__ = "0.1.0"
