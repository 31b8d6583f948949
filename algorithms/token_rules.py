"""The token rules of the entropy baselines and relatives (``RULES`` below lists them), registered by name (as verl
registers its policy losses).

``AlgoConfig.token_rule`` is a rule's name (a plain ``--set`` key); ``AlgoConfig.rule`` is the rule object, and
everything that depends on the rule asks the object, never the name:

- ``settings``: the AlgoConfig fields it reads (the GPU dry run prints them under "stare");
- ``exclusive``: of those, the ones that mean something to this rule only: with any other rule they must keep their
  default;
- ``needs_entropy``: it reads the old policy's per-token entropy, so the engines compute it whatever the telemetry;
- ``unclipped``: its surrogate is -A r for every token (no clip, no dual clip);
- ``random``: it draws random numbers, from a generator the engine keeps for it alone;
- ``choice``: its weights mark a choice (0 dropped; kept tokens 1, or 80-20's N / S), so the telemetry's shares
  count what it kept; False for weights that scale each token (entropy-adv, dg), whose shares count the weights;
- ``active``: False for "none" only: with a rule active, ``stare_step`` runs every step whatever the telemetry;
- ``validate(cfg)``: its checks beyond each setting's own range;
- ``apply(...)``: the step's numbers -> ``(weights, penalty)``, once over the whole step's batch: a 0/1 mask,
  80-20's N / S weights, entropy-adv's shaping or dg's gate as ``weights``, KL-Cov's coefficients as ``penalty``
  (the pure functions of baselines.py);
- ``telemetry``: the numbers it logs beyond the shared ones (``RuleMetric``: name, meaning, the comparison's column
  header), written once here: step.METRICS lists them, the steps drop a share of nothing, and ``stare compare``
  reads them (TensorBoard too) into its "Selection telemetry" table;
- ``telemetry_sums(...)``: those numbers as (numerator, denominator) pairs by name, summed over the ranks with the
  rest of the step's telemetry.

A new rule is a subclass decorated with ``@register_token_rule`` (here, its maths in baselines.py, or in a module of
your own); its name is then a valid ``token_rule`` and both engines run it. A rule outside this package reads the
existing settings only (settings of its own are AlgoConfig fields, each with its row in ``settings.py``). Its module
must be imported in every process that trains: ``STARE_TOKEN_RULE_MODULES=pkg.mod[,pkg2.mod2]`` names modules that
``get_token_rule`` and ``TOKEN_RULES`` import on first need (``stare train`` forwards the variable to OpenRLHF's Ray
workers); a script that imports its module before training needs no variable (docs/architecture.md has a worked
example).

No torch at import: the registry's validation and ``stare algos`` read these objects; ``apply`` imports
baselines.py (torch) when it first runs.
"""
from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from dataclasses import dataclass

from ._plain import check_range

MODULES_ENV = "STARE_TOKEN_RULE_MODULES"  # comma-separated modules that register token rules, imported on first need


@dataclass(frozen=True)
class RuleMetric:
    """One number a token rule logs as ``stare/<name>`` (its ``telemetry_sums`` returns it under ``name``): what it
    means (a line of step.METRICS, prefixed with the rule's name), the header of its column in the comparison's
    "Selection telemetry" table, and ``absent_when_none``: a step where its denominator is 0 (a share of nothing)
    leaves it out instead of logging 0."""
    name: str
    meaning: str
    header: str
    absent_when_none: bool = False


class TokenRule:
    """A token rule (subclass it). As is, the rule "none": no token rule, every weight 1, no penalty."""

    name = "none"
    active = False
    settings: tuple[str, ...] = ()
    telemetry: tuple[RuleMetric, ...] = ()
    exclusive: tuple[str, ...] = ()
    needs_entropy = False
    unclipped = False
    random = False
    choice = True

    def validate(self, cfg) -> None:
        """Raise ValueError when ``cfg`` (an AlgoConfig whose every setting is in its own range) does not suit the
        rule."""

    def apply(self, cfg, logprobs, advantages, mask, entropy, *, group=None, generator=None):
        """``(weights [B, T] float32 or None, penalty [B, T] float32 or None)`` over the whole step's batch.

        ``logprobs`` ``[B, T]`` (the old policy's), ``advantages`` ``[B, T]`` or ``[B]``, ``mask`` ``[B, T]``,
        ``entropy`` ``[B, T]`` (None unless ``needs_entropy`` or the telemetry asked for it); ``group`` a
        torch.distributed group (exact across its ranks), ``generator`` the engine's own (``random`` rules)."""
        return None, None

    def telemetry_sums(self, cfg, logprobs, advantages, mask, entropy, weights) -> dict:
        """``{name: (numerator, denominator)}`` 0-dim tensors over this rank's tokens (telemetry "full" only); the
        arguments as ``apply``'s, and the ``weights`` it returned (this rank's rows)."""
        return {}

    def __repr__(self) -> str:
        return f"<token rule {self.name}>"


class ClipCov(TokenRule):
    """Clip-Cov: no gradient through a random clip_ratio share of the tokens whose log-prob/advantage covariance
    lies in (cov_low, cov_high): a 0/1 mask as the weights."""

    name = "clip-cov"
    active = True
    settings = ("clip_ratio", "cov_low", "cov_high")
    random = True

    def apply(self, cfg, logprobs, advantages, mask, entropy, *, group=None, generator=None):
        from .baselines import clip_cov_weights

        return clip_cov_weights(logprobs, advantages, mask, clip_ratio=cfg.clip_ratio, cov_low=cfg.cov_low,
                                cov_high=cfg.cov_high, generator=generator, group=group), None


class KLCov(TokenRule):
    """KL-Cov: the |log-ratio| penalty (coefficient kl_cov_coef) on the top k_ratio tokens by covariance, on the
    unclipped surrogate."""

    name = "kl-cov"
    active = True
    settings = ("k_ratio", "kl_cov_coef")
    unclipped = True

    def apply(self, cfg, logprobs, advantages, mask, entropy, *, group=None, generator=None):
        from .baselines import kl_cov_coefs

        return None, kl_cov_coefs(logprobs, advantages, mask, k_ratio=cfg.k_ratio, kl_coef=cfg.kl_cov_coef,
                                  group=group)


class TopEntropy(TokenRule):
    """80/20: the policy gradient through the top top_ratio tokens by the old policy's entropy only (weight 1, or
    N / S with mask_denominator selected), 0 elsewhere."""

    name = "80-20"
    active = True
    settings = ("top_ratio", "mask_denominator")
    exclusive = ("mask_denominator",)
    needs_entropy = True

    def validate(self, cfg) -> None:
        check_range("top_ratio", cfg.top_ratio, 0, 1, low_open=True)  # a share of 0 would train on nothing

    def apply(self, cfg, logprobs, advantages, mask, entropy, *, group=None, generator=None):
        from .baselines import entropy_top_weights

        return entropy_top_weights(entropy, mask, top_ratio=cfg.top_ratio, group=group,
                                   denominator=cfg.mask_denominator), None


class EntropyAdvantage(TokenRule):
    """entropy-adv: each token's advantage A + min(entropy_adv_alpha H, |A| / entropy_adv_kappa), as a weight on its
    loss (H the old policy's entropy, detached)."""

    name = "entropy-adv"
    active = True
    settings = ("entropy_adv_alpha", "entropy_adv_kappa")
    exclusive = ("entropy_adv_alpha", "entropy_adv_kappa")
    needs_entropy = True
    choice = False
    telemetry = (
        RuleMetric("shaped_share", "share of the A != 0 response tokens whose advantage the entropy term changed "
                   "(H > 0)", "shaped"),
        RuleMetric("shaping_clipped_share", "of the shaped tokens, the share whose term is held at the bound "
                   "abs(A) / kappa", "shaping clipped", absent_when_none=True),
    )

    def apply(self, cfg, logprobs, advantages, mask, entropy, *, group=None, generator=None):
        from .baselines import entropy_advantage_weights

        return entropy_advantage_weights(advantages, entropy, mask, alpha=cfg.entropy_adv_alpha,
                                         kappa=cfg.entropy_adv_kappa), None

    def telemetry_sums(self, cfg, logprobs, advantages, mask, entropy, weights) -> dict:
        from .baselines import entropy_advantage_sums

        return entropy_advantage_sums(advantages, entropy, mask, alpha=cfg.entropy_adv_alpha,
                                      kappa=cfg.entropy_adv_kappa)


class DelightGate(TokenRule):
    """dg: the Delightful Policy Gradient gate, each token's loss times sigmoid(A (-log p) / dg_eta), log p the old
    policy's log-prob of the sampled token (detached)."""

    name = "dg"
    active = True
    settings = ("dg_eta",)
    exclusive = ("dg_eta",)
    choice = False
    telemetry = (
        RuleMetric("gate_mean", "mean of the delight gate sigmoid(A (-log p) / eta) over the A != 0 response tokens",
                   "gate mean", absent_when_none=True),
        RuleMetric("gate_low_share", "share of the A != 0 response tokens whose gate is below 0.1 (nearly no "
                   "gradient)", "gate<0.1"),
        RuleMetric("gate_high_share", "share of the A != 0 response tokens whose gate is above 0.9 (nearly all of "
                   "it)", "gate>0.9"),
    )

    def apply(self, cfg, logprobs, advantages, mask, entropy, *, group=None, generator=None):
        from .baselines import delight_gate_weights

        return delight_gate_weights(logprobs, advantages, mask, eta=cfg.dg_eta), None

    def telemetry_sums(self, cfg, logprobs, advantages, mask, entropy, weights) -> dict:
        from .baselines import delight_gate_sums

        return delight_gate_sums(weights, advantages, mask)


class Steer(TokenRule):
    """steer: each token's loss times a weight that falls with the size of its estimated entropy change
    |A (1 - p) (log p + H)| (old policy's p and H), by steer_mapping (exp: down to steer_weight_min for the largest;
    linear: from steer_weight_max for the smallest to steer_weight_min for the largest), over the step's batch."""

    name = "steer"
    active = True
    settings = ("steer_mapping", "steer_weight_min", "steer_weight_max")
    exclusive = settings
    needs_entropy = True
    choice = False
    telemetry = (
        RuleMetric("steer_floor_share", "share of the response tokens held at steer_weight_min (the largest "
                   "estimated entropy changes)", "steer floor"),
        RuleMetric("steer_raise_share", "of the response tokens with an estimated entropy change, the share whose "
                   "estimate says the update raises entropy (A (1 - p) (log p + H) < 0)", "steer raise",
                   absent_when_none=True),
    )

    def validate(self, cfg) -> None:
        if cfg.steer_mapping == "exp":
            check_range("steer_weight_min", cfg.steer_weight_min, 0, 1, low_open=True, high_open=True)
        elif not cfg.steer_weight_max > cfg.steer_weight_min:
            raise ValueError(f"steer_weight_max {cfg.steer_weight_max!r} must be > steer_weight_min "
                             f"{cfg.steer_weight_min!r} with steer_mapping linear")

    def apply(self, cfg, logprobs, advantages, mask, entropy, *, group=None, generator=None):
        from .baselines import steer_weights

        return steer_weights(logprobs, advantages, entropy, mask, mapping=cfg.steer_mapping,
                             weight_min=cfg.steer_weight_min, weight_max=cfg.steer_weight_max, group=group), None

    def telemetry_sums(self, cfg, logprobs, advantages, mask, entropy, weights) -> dict:
        from .baselines import steer_sums

        return steer_sums(logprobs, advantages, entropy, mask, weights, weight_min=cfg.steer_weight_min)


# THE registry: name -> rule, in the order the choices are listed (the built-in rules, then registered ones).
RULES: dict[str, TokenRule] = {rule.name: rule for rule in (TokenRule(), ClipCov(), KLCov(), TopEntropy(),
                                                            EntropyAdvantage(), DelightGate(), Steer())}
_imported: set[str] = set()  # the modules of MODULES_ENV imported so far


def register_token_rule(cls: type[TokenRule]) -> type[TokenRule]:
    """Class decorator: register an instance of the TokenRule subclass ``cls`` under ``cls.name``; returns ``cls``.

    Raises ValueError when ``cls`` is not a TokenRule subclass, its name is not a non-empty string, or another rule
    already has that name (a name means one rule in every process of a run)."""
    if not (isinstance(cls, type) and issubclass(cls, TokenRule)) or cls is TokenRule:
        raise ValueError(f"register_token_rule takes a subclass of TokenRule, got {cls!r}")
    name = cls.__dict__.get("name")
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ValueError(f"{cls.__qualname__}: a token rule needs a name of its own (a non-empty string without "
                         f"surrounding spaces), got {name!r}")
    if name in RULES and type(RULES[name]) is not cls:
        raise ValueError(f"token rule {name!r} is already registered ({type(RULES[name]).__qualname__}); "
                         f"choose another name (registered: {', '.join(RULES)})")
    RULES[name] = cls()
    return cls


def _import_rule_modules() -> None:
    """Import the modules ``STARE_TOKEN_RULE_MODULES`` names (each once); ImportError naming the module."""
    for module in filter(None, (m.strip() for m in os.environ.get(MODULES_ENV, "").split(","))):
        if module in _imported:
            continue
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ImportError(f"{MODULES_ENV}: cannot import token-rule module {module!r} ({exc}); it must be "
                              "importable in every process of the run (installed, or on PYTHONPATH)") from exc
        _imported.add(module)


class _RuleNames(Sequence):
    """The registered rules' names, read live (so a rule registered later is a valid ``token_rule``); compares
    equal to the tuple of the same names."""

    def _names(self) -> tuple[str, ...]:
        _import_rule_modules()
        return tuple(RULES)

    def __getitem__(self, i):
        return self._names()[i]

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name) -> bool:
        return name in self._names()

    def __iter__(self):
        return iter(self._names())

    def __eq__(self, other) -> bool:
        return tuple(self) == (tuple(other) if isinstance(other, (tuple, list, _RuleNames)) else other)

    __hash__ = None

    def __repr__(self) -> str:
        return repr(self._names())


TOKEN_RULES: Sequence[str] = _RuleNames()


def get_token_rule(name: str) -> TokenRule:
    """The rule registered as ``name``; ValueError listing the valid names otherwise."""
    if isinstance(name, str) and name not in RULES:
        _import_rule_modules()
    if not isinstance(name, str) or name not in RULES:
        raise ValueError(f"unknown token_rule {name!r}; valid choices: {', '.join(TOKEN_RULES)}")
    return RULES[name]
