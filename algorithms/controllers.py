"""Entropy controllers: once per step, turn the batch entropy of the old policy into STARE's settings.

``PaperGate`` is the published rule: the gate is on while the batch entropy is below the target, with
optional adaptive W/M that take a step of ``alpha`` towards stronger (weaker) reweighting each step the
entropy is below (above) the target.

``BandGate`` is this project's controller for a target band [low, high]. Below ``target`` (default: the
band's top, ``high``) the gate is on with a strength that grows in proportion to the shortfall, reaching full
strength at ``low``; above ``target`` nothing happens (dead zone) up to ``high``; above ``high`` it is off,
or with ``two_sided`` it pushes entropy down with a strength that grows with the excess. (The default target
is the band's top because the push fades as entropy nears the target: with a target in the band's middle,
entropy can settle just below ``low``; docs/algorithm.md.) Strength s scales how far the weights move from 1:
W_eff = 1 + s (W - 1), M_eff = 1 - s (1 - M), damp_eff = 1 - s (1 - damp).

Both keep their state in ``state_dict()`` so a resumed run takes the same decisions.

``EntropyCoef`` is not a gate but the coefficient of an entropy bonus in the loss (``loss.entropy_bonus_loss``):
fixed, or adapted each step as Skywork-OR1's adaptive entropy control does (and TRL's ``use_adaptive_entropy``):
raised by ``delta`` when the batch entropy is at or below the target, lowered by ``delta`` above it, held within
[``coef_min``, ``coef_max``], and applied only while the entropy is at or below the target.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from ._plain import check_range


@dataclass(frozen=True)
class ControllerState:
    """What the controller decided for this step."""

    gate_on: bool
    w: float
    m: float
    damp: float
    direction: int  # +1 raise entropy, -1 lower it
    strength: float  # 0..1
    entropy: float  # the batch entropy that was fed in
    target: float

    def weight_kwargs(self) -> dict:
        """Keyword arguments for ``stare_token_weights``."""
        return {"gate_on": self.gate_on, "w": self.w, "m": self.m, "damp": self.damp, "direction": self.direction}

    def as_metrics(self, prefix: str = "stare/") -> dict[str, float]:
        d = asdict(self)
        d["gate_on"] = float(self.gate_on)
        d["direction"] = float(self.direction)
        return {f"{prefix}{k}": float(v) for k, v in d.items()}


def _check_entropy(batch_entropy) -> float:
    value = float(batch_entropy)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"batch_entropy must be a finite number >= 0, got {value!r}")
    return value


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


class PaperGate:
    """Binary gate at ``target_entropy``, optional adaptive W/M (the reference's rule)."""

    def __init__(
        self,
        target_entropy: float = 0.3,
        w: float = 1.1,
        m: float = 0.9,
        *,
        adaptive: bool = False,
        alpha: float = 0.01,
        w_max: float = 1.5,
        m_min: float = 0.5,
    ):
        check_range("target_entropy", target_entropy, 0, None, low_open=True)
        check_range("w", w, 0, None, low_open=True)
        check_range("m", m, 0, None, low_open=True)
        check_range("alpha", alpha, 0, None)
        check_range("w_max", w_max, 1, None)
        check_range("m_min", m_min, 0, 1, low_open=True)
        if adaptive:
            check_range("w", w, 1, w_max)
            check_range("m", m, m_min, 1)
        self.target_entropy = target_entropy
        self.adaptive = adaptive
        self.alpha, self.w_max, self.m_min = alpha, w_max, m_min
        self.w, self.m = w, m
        self.steps = 0
        self.last: ControllerState | None = None

    def update(self, batch_entropy) -> ControllerState:
        h = _check_entropy(batch_entropy)
        if self.adaptive:
            step = self.alpha * _sign(self.target_entropy - h)
            self.w = min(max(self.w + step, 1.0), self.w_max)
            self.m = min(max(self.m - step, self.m_min), 1.0)
        gate_on = h < self.target_entropy
        self.steps += 1
        self.last = ControllerState(gate_on, self.w, self.m, 1.0, 1, 1.0 if gate_on else 0.0, h, self.target_entropy)
        return self.last

    def state_dict(self) -> dict:
        return {"kind": "paper", "w": self.w, "m": self.m, "steps": self.steps,
                "last": None if self.last is None else asdict(self.last)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "paper":
            raise ValueError(f"state is for controller kind {state.get('kind')!r}, not 'paper'")
        self.w, self.m, self.steps = float(state["w"]), float(state["m"]), int(state["steps"])
        self.last = None if state["last"] is None else ControllerState(**state["last"])


class BandGate:
    """Target band [low, high]: proportional push up below ``target``, dead zone above, optional push down.

    ``w``, ``m`` and ``damp`` (the weights at full strength) have no defaults here: an algorithm's own come from its
    ``AlgoConfig`` (``make_controller``), so there is one place that says what they are."""

    def __init__(
        self,
        low: float = 0.3,
        high: float = 0.45,
        *,
        target: float | None = None,
        w: float,
        m: float,
        damp: float,
        gain: float = 1.0,
        two_sided: bool = False,
    ):
        check_range("band low", low, 0, None, low_open=True)
        check_range("band high", high, 0, None, low_open=True)
        if low > high:
            raise ValueError(f"band low must be <= band high, got low={low!r} > high={high!r}")
        target = high if target is None else target
        check_range("target", target, low, high)
        check_range("w", w, 1, None)
        check_range("m", m, 0, 1, low_open=True)
        check_range("damp", damp, 0, 1, low_open=True)
        check_range("gain", gain, 0, None, low_open=True)
        self.low, self.high, self.target = low, high, target
        self.w, self.m, self.damp, self.gain, self.two_sided = w, m, damp, gain, two_sided
        self.steps = 0
        self.last: ControllerState | None = None

    def strength_for(self, h: float) -> tuple[float, int]:
        """(strength in [0, 1], direction) for batch entropy ``h``."""
        if h < self.target:
            span = self.target - self.low
            s = 1.0 if span <= 0 else min(1.0, self.gain * (self.target - h) / span)
            return s, 1
        if self.two_sided and h > self.high:
            span = self.high - self.target
            s = 1.0 if span <= 0 else min(1.0, self.gain * (h - self.high) / span)
            return s, -1
        return 0.0, 1

    def update(self, batch_entropy) -> ControllerState:
        h = _check_entropy(batch_entropy)
        s, direction = self.strength_for(h)
        self.steps += 1
        self.last = ControllerState(
            gate_on=s > 0,
            w=1.0 + s * (self.w - 1.0),
            m=1.0 - s * (1.0 - self.m),
            damp=1.0 - s * (1.0 - self.damp),
            direction=direction,
            strength=s,
            entropy=h,
            target=self.target,
        )
        return self.last

    def state_dict(self) -> dict:
        return {"kind": "band", "steps": self.steps, "last": None if self.last is None else asdict(self.last)}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "band":
            raise ValueError(f"state is for controller kind {state.get('kind')!r}, not 'band'")
        self.steps = int(state["steps"])
        self.last = None if state["last"] is None else ControllerState(**state["last"])


class EntropyCoef:
    """The entropy bonus's coefficient, once per step: ``coef`` every step, or (``adaptive``) Skywork-OR1's rule.

    Adaptive, for the step's batch entropy h (the old policy's, measured before the update)::

        c <- min(c + delta, coef_max)   if h <= target
        c <- max(c - delta, coef_min)   otherwise
        applied = c if h <= target else 0

    TRL's ``GRPOTrainer`` runs the same update on the entropy it measures during the update, so it applies the
    coefficient one step later: its step k + 1 applies what this applies at step k (tests/test_controllers.py
    checks the sequences against TRL's update on the same entropy trace). ``coef`` is the value before the first
    step (TRL's ``entropy_coef``).
    """

    def __init__(self, coef: float = 0.0, *, adaptive: bool = False, target: float = 0.2, delta: float = 0.005,
                 coef_min: float = 0.0, coef_max: float = 1.0):
        check_range("entropy_coef", coef, 0, None)
        check_range("entropy_target", target, 0, None, low_open=True)
        check_range("entropy_coef_delta", delta, 0, None)
        check_range("entropy_coef_min", coef_min, 0, None)
        if coef_max < coef_min:
            raise ValueError(f"entropy_coef_max must be >= entropy_coef_min, got {coef_max!r} < {coef_min!r}")
        if adaptive:
            check_range("entropy_coef", coef, coef_min, coef_max)
        self.coef, self.adaptive, self.target, self.delta = coef, adaptive, target, delta
        self.coef_min, self.coef_max = coef_min, coef_max
        self.steps = 0
        self.applied: float | None = None  # the last step's coefficient

    def update(self, batch_entropy) -> float:
        """The coefficient to apply this step, given the step's batch entropy."""
        h = _check_entropy(batch_entropy)
        if self.adaptive:
            below = h <= self.target
            if below:
                self.coef = min(self.coef + self.delta, self.coef_max)
            else:
                self.coef = max(self.coef - self.delta, self.coef_min)
            self.applied = self.coef if below else 0.0
        else:
            self.applied = self.coef
        self.steps += 1
        return self.applied

    def state_dict(self) -> dict:
        return {"kind": "entropy_coef", "coef": self.coef, "steps": self.steps, "applied": self.applied}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "entropy_coef":
            raise ValueError(f"state is for controller kind {state.get('kind')!r}, not 'entropy_coef'")
        self.coef, self.steps = float(state["coef"]), int(state["steps"])
        self.applied = None if state["applied"] is None else float(state["applied"])
