"""stare.eval: benchmark evaluation (avg@k, pass@k).

The benchmark harness (``stare eval``) is tracked in its own issue; the metrics below are shared with the
local engine's held-out evaluation.
"""
from .metrics import pass_at_k

__all__ = ["pass_at_k"]
