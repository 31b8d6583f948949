"""stare.algorithms: GRPO, DAPO, STARE and the entropy baselines (Clip-Cov, KL-Cov, 80/20, Skywork-OR1's adaptive
entropy bonus, entropy-based advantage shaping, the Delightful Policy Gradient gate) as pure functions.

No import of OpenRLHF, Ray or vLLM: the local engine, the OpenRLHF plugin and users' own trainers all call
the same code; ``stare_step`` (``step.py``) is the once-per-step block both engines run, and ``METRICS`` there
lists the telemetry names with their meanings. See docs/algorithm.md for the mathematics.
"""
# The registry and the controllers need no torch and load now; everything else loads from its module on first use
# (a module __getattr__), so `stare algos`, `stare presets` and `stare --help` never import torch. Every name below
# is importable from stare.algorithms.
from .controllers import BandGate, ControllerState, EntropyCoef, PaperGate
from .registry import ALGORITHMS, SETTING_NAMES, AlgoConfig, get_algorithm
from .token_rules import TOKEN_RULES, TokenRule, get_token_rule, register_token_rule

_LAZY = {
    "_checks": ("check_finite",),
    "baselines": ("clip_cov_seed", "clip_cov_weights", "delight_gate_weights", "entropy_advantage_weights",
                  "entropy_top_weights", "steer_change", "steer_weights",
                  "floor_count", "kl_cov_coefs", "token_covariance"),
    "advantages": ("group_advantages", "informative_groups", "overlong_penalty"),
    "entropy": ("EntropyStats", "entropy_forecast_sums", "entropy_sensitivity", "masked_mean",
                "predicted_entropy_change", "quadrant_stats", "quadrant_sums", "token_entropy"),
    "loss": ("AGGREGATIONS", "entropy_bonus_loss", "policy_loss"),
    "selection": ("kth_largest", "reweight_stats", "reweight_sums", "stare_token_weights", "top_count"),
    "step": ("LEGACY_NAMES", "METRIC_NAMES", "METRICS", "StepMemory", "StepResult", "batch_mean",
             "entropy_bonus_metrics", "metrics_markdown",
             "stare_step", "upgrade_metric_names"),
}
_WHERE = {name: module for module, names in _LAZY.items() for name in names}


def __getattr__(name: str):
    module = _WHERE.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value  # once: later look-ups are plain attribute reads
    return value


def __dir__():
    return sorted(set(globals()) | set(_WHERE))


__all__ = [
    "AGGREGATIONS", "ALGORITHMS", "AlgoConfig", "BandGate", "ControllerState", "EntropyCoef", "EntropyStats",
    "LEGACY_NAMES", "METRICS", "METRIC_NAMES", "PaperGate", "SETTING_NAMES", "StepMemory", "StepResult",
    "TOKEN_RULES", "TokenRule", "batch_mean", "check_finite", "clip_cov_seed", "clip_cov_weights",
    "delight_gate_weights",
    "entropy_advantage_weights", "entropy_bonus_loss", "entropy_bonus_metrics", "entropy_forecast_sums",
    "entropy_sensitivity", "entropy_top_weights", "floor_count", "get_algorithm", "get_token_rule", "group_advantages",
    "informative_groups",
    "kl_cov_coefs", "kth_largest", "masked_mean", "metrics_markdown", "overlong_penalty", "policy_loss",
    "predicted_entropy_change", "quadrant_stats", "quadrant_sums", "register_token_rule", "reweight_stats",
    "reweight_sums", "stare_step", "stare_token_weights", "steer_change", "steer_weights", "token_covariance",
    "token_entropy", "top_count",
    "upgrade_metric_names",
]
