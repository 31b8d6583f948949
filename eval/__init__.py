"""stare.eval: benchmark evaluation building blocks (data, math-verify scoring, avg@k / pass@k / maj@k, intervals).

``stare eval`` is ``harness`` (the run loop) with ``protocols`` (sampling settings, sample seeds), ``backends``
(HF and vLLM), ``record`` (an output folder's settings and resume) and ``summary``; answers are read by
``extraction`` and judged by ``scoring`` (math-verify in ``verify_pool``'s worker processes). ``lm_eval_harness``
runs the lm-eval tasks shipped in ``lm_eval_tasks`` (``stare eval --harness lm-eval``); the local engine uses
``pass_at_k`` for its held-out numbers.
"""
from .data import BENCHES, Problem, load_bench, repair_escapes
from .metrics import (
    avg_at_k,
    bootstrap_ci,
    count_reflections,
    maj_at_k,
    majority_votes,
    pass_at_k,
    pass_at_k_mean,
    per_problem_accuracy,
    permutation_test,
    reflection_rate,
)
from .extraction import extract_boxed
from .scoring import ScoringError, check_many, is_correct, score_many, shutdown

__all__ = [
    "BENCHES", "Problem", "avg_at_k", "bootstrap_ci", "count_reflections", "load_bench", "maj_at_k",
    "majority_votes", "pass_at_k", "pass_at_k_mean", "per_problem_accuracy", "permutation_test",
    "reflection_rate", "repair_escapes", "extract_boxed", "is_correct", "score_many", "shutdown", "ScoringError",
    "check_many",
]
