"""The entropy baselines' token rules, registered by name (as verl registers its policy losses).

``AlgoConfig.token_rule`` is a rule's name (a plain ``--set`` key); ``AlgoConfig.rule`` is the rule object, and
everything that depends on the rule asks the object, never the name:

- ``settings``: the AlgoConfig fields it reads (the GPU dry run prints them under "stare");
- ``exclusive``: of those, the ones that mean something to this rule only: with any other rule they must keep their
  default;
- ``needs_entropy``: it reads the old policy's per-token entropy, so the engines compute it whatever the telemetry;
- ``unclipped``: its surrogate is -A r for every token (no clip, no dual clip);
- ``random``: it draws random numbers, from a generator the engine keeps for it alone;
- ``active``: False for "none" only: with a rule active, ``stare_step`` runs every step whatever the telemetry;
- ``validate(cfg)``: its checks beyond each setting's own range;
- ``apply(...)``: the step's numbers -> ``(weights, penalty)``, once over the whole step's batch: a 0/1 mask or
  80-20's N / S weights as ``weights``, KL-Cov's coefficients as ``penalty`` (the pure functions of baselines.py).

A new rule is one subclass here and one entry in ``RULES`` (its maths in baselines.py); its name is then a valid
``token_rule`` and both engines run it. Settings of its own are AlgoConfig fields, each with its row in
``settings.py``, like any other setting.

No torch at import: the registry's validation and ``stare algos`` read these objects; ``apply`` imports
baselines.py (torch) when it first runs.
"""
from __future__ import annotations

from ._plain import check_range


class TokenRule:
    """A token rule (subclass it). As is, the rule "none": no token rule, every weight 1, no penalty."""

    name = "none"
    active = False
    settings: tuple[str, ...] = ()
    exclusive: tuple[str, ...] = ()
    needs_entropy = False
    unclipped = False
    random = False

    def validate(self, cfg) -> None:
        """Raise ValueError when ``cfg`` (an AlgoConfig whose every setting is in its own range) does not suit the
        rule."""

    def apply(self, cfg, logprobs, advantages, mask, entropy, *, group=None, generator=None):
        """``(weights [B, T] float32 or None, penalty [B, T] float32 or None)`` over the whole step's batch.

        ``logprobs`` ``[B, T]`` (the old policy's), ``advantages`` ``[B, T]`` or ``[B]``, ``mask`` ``[B, T]``,
        ``entropy`` ``[B, T]`` (None unless ``needs_entropy`` or the telemetry asked for it); ``group`` a
        torch.distributed group (exact across its ranks), ``generator`` the engine's own (``random`` rules)."""
        return None, None

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


# THE registry: name -> rule, in the order the choices are listed.
RULES: dict[str, TokenRule] = {rule.name: rule for rule in (TokenRule(), ClipCov(), KLCov(), TopEntropy())}
TOKEN_RULES = tuple(RULES)


def get_token_rule(name: str) -> TokenRule:
    """The rule registered as ``name``; ValueError listing the valid names otherwise."""
    if not isinstance(name, str) or name not in RULES:
        raise ValueError(f"unknown token_rule {name!r}; valid choices: {', '.join(TOKEN_RULES)}")
    return RULES[name]
