"""The parts of stare.algorithms that need no torch: the scalar argument checks and the names of the choices.

``stare algos``, ``stare presets`` and the preset checks read the registry (``registry.py``), which needs only
these; keeping them free of torch keeps those commands fast (importing torch takes seconds). ``_checks``,
``entropy``, ``loss`` and ``selection`` re-export them under their old names.
"""
from __future__ import annotations

import math

KERNELS = ("auto", "torch", "triton", "compiled", "cpp")  # entropy.py: the entropy_sensitivity kernels
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")  # loss.py
VARIANTS = ("O1", "C2")  # selection.py
SELECTIONS = ("quantile", "phi")  # selection.py
# baselines.py, 80-20: the loss over the selected tokens (the 80/20 paper's code) or over all (TRL's)
MASK_DENOMINATORS = ("all", "selected")
STEER_MAPPINGS = ("exp", "linear")  # steer: how |Omega| becomes a weight (baselines.steer_weights)
CONTROLLERS = ("paper", "band")  # controllers.py: PaperGate, BandGate
SCOPES = ("global", "micro_batch")  # step.py: where STARE's selection is made
# What the per-step telemetry may cost: full (entropy, shares, Phi forecasts), entropy (the batch entropy only,
# no Phi unless the selection needs it), off (nothing beyond what the algorithm needs: a baseline computes no
# statistics at all, STARE still the gate's entropy).
TELEMETRY = ("full", "entropy", "off")


def check_range(name: str, value, low=None, high=None, *, low_open=False, high_open=False) -> None:
    """Raise unless ``low <(=) value <(=) high``; the message names the parameter and the range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")
    bad_low = low is not None and (value <= low if low_open else value < low)
    bad_high = high is not None and (value >= high if high_open else value > high)
    if bad_low or bad_high:
        left = "(" if low_open else "["
        right = ")" if high_open else "]"
        lo = "-inf" if low is None else low
        hi = "inf" if high is None else high
        raise ValueError(f"{name} must be in {left}{lo}, {hi}{right}, got {value!r}")


def check_choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; valid choices: {', '.join(map(str, choices))}")
