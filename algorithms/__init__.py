"""stare.algorithms: GRPO, DAPO and STARE as pure functions on tensors.

No import of OpenRLHF, Ray or vLLM: the local engine, the OpenRLHF plugin and users' own trainers all call
the same code. See docs/algorithm.md for the mathematics.
"""
from ._checks import check_finite
from .advantages import group_advantages, informative_groups, overlong_penalty
from .controllers import BandGate, ControllerState, PaperGate
from .entropy import EntropyStats, entropy_sensitivity, masked_mean, predicted_entropy_change, quadrant_stats
from .loss import AGGREGATIONS, policy_loss
from .registry import ALGORITHMS, SETTING_NAMES, AlgoConfig, get_algorithm
from .selection import kth_largest, reweight_stats, stare_token_weights, top_count

__all__ = [
    "AGGREGATIONS", "ALGORITHMS", "SETTING_NAMES", "AlgoConfig", "BandGate", "ControllerState", "EntropyStats",
    "PaperGate", "check_finite", "entropy_sensitivity", "get_algorithm", "group_advantages", "informative_groups",
    "kth_largest", "masked_mean", "overlong_penalty", "policy_loss", "predicted_entropy_change", "quadrant_stats",
    "reweight_stats", "stare_token_weights", "top_count",
]
