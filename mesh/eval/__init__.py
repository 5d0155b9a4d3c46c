"""The evaluator (`deltamesh eval`): a policy's published versions scored on a held-out set with avg@n
through a real engine, beside training and never in its way; results stored with the version and the
weights hash the engine proved it served, served over HTTP and as Prometheus metrics."""

from deltamesh.mesh.eval.config import EvalConfig, HeldoutConfig
from deltamesh.mesh.eval.store import EvalResult, EvalStore

__all__ = ["EvalConfig", "EvalResult", "EvalStore", "HeldoutConfig"]
