"""stare.eval: benchmark evaluation (avg@k with math-verify scoring).

The harness itself (``stare eval``) is tracked in its own issue; this package exists so that the
``stare`` namespace layout is complete from the start.
"""
