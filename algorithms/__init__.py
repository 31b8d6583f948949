"""stare.algorithms: GRPO, DAPO, STARE and the entropy baselines (Clip-Cov, KL-Cov, 80/20) as pure functions.

No import of OpenRLHF, Ray or vLLM: the local engine, the OpenRLHF plugin and users' own trainers all call
the same code; ``stare_step`` (``step.py``) is the once-per-step block both engines run, and ``METRICS`` there
lists the telemetry names with their meanings. See docs/algorithm.md for the mathematics.
"""
from ._checks import check_finite
from .baselines import clip_cov_seed, clip_cov_weights, entropy_top_weights, floor_count, kl_cov_coefs, token_covariance
from .advantages import group_advantages, informative_groups, overlong_penalty
from .controllers import BandGate, ControllerState, PaperGate
from .entropy import (EntropyStats, entropy_forecast_sums, entropy_sensitivity, masked_mean, predicted_entropy_change,
                      quadrant_stats, quadrant_sums)
from .loss import AGGREGATIONS, policy_loss
from .registry import ALGORITHMS, SETTING_NAMES, TOKEN_RULES, AlgoConfig, get_algorithm
from .selection import kth_largest, reweight_stats, reweight_sums, stare_token_weights, top_count
from .step import (LEGACY_NAMES, METRIC_NAMES, METRICS, StepMemory, StepResult, batch_mean, metrics_markdown, stare_step,
                   upgrade_metric_names)

__all__ = [
    "AGGREGATIONS", "ALGORITHMS", "LEGACY_NAMES", "METRICS", "METRIC_NAMES", "SETTING_NAMES", "TOKEN_RULES",
    "AlgoConfig", "BandGate", "ControllerState", "EntropyStats", "PaperGate", "StepMemory", "StepResult",
    "batch_mean", "check_finite", "clip_cov_seed", "clip_cov_weights", "entropy_forecast_sums", "entropy_sensitivity",
    "entropy_top_weights", "floor_count", "get_algorithm", "group_advantages", "informative_groups", "kl_cov_coefs",
    "kth_largest", "masked_mean", "metrics_markdown", "overlong_penalty", "policy_loss", "predicted_entropy_change",
    "quadrant_stats", "quadrant_sums", "reweight_stats", "reweight_sums", "stare_step", "stare_token_weights",
    "token_covariance", "top_count", "upgrade_metric_names",
]
